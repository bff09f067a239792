"""A sentence-transformers checkpoint as one model: its transformer, pooling and head, behind
`/v1/embeddings`.

Reads the checkpoint directory:
  * modules.json: a `Transformer` module (a Hugging Face model: config.json and safetensors weights
    in the module's path, usually the root), a `Pooling` module (its folder's config.json), then any
    `Dense` modules (a linear map of the pooled vector, Identity or Tanh after it: EmbeddingGemma's
    2_Dense and 3_Dense) and a `Normalize` module, applied in that order. Without modules.json the
    model is pooled as sentence-transformers pools a plain Hugging Face checkpoint: the last token
    for a causal decoder, else the mean of the tokens, unnormalised.
  * sentence_bert_config.json: `max_seq_length`, the longest input the model was trained for.

The transformer is engine.models.encoder's (BERT, XLM-RoBERTa) or engine.models.decoder_embedder's
(EmbeddingGemma, Qwen3-Embedding), chosen by config.json's model_type. Pooling masks padding out,
so a row's embedding does not depend on what else shares its batch or how far it is padded. The
pooling, the Dense modules and the normalisation run in float32; the output is always float32.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Optional, Union

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from safetensors.numpy import load_file

from engine.formats.checkpoint_config import read_hf_config
from engine.layers.transformer import Pos
from engine.models import decoder_embedder, encoder

logger = logging.getLogger(__name__)

FAMILIES = encoder.FAMILIES + decoder_embedder.FAMILIES
"""config.json model types the embedding engine runs."""
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len", "lasttoken")
"""The pooling modes served, in the order sentence-transformers' legacy flags concatenate them."""
_LEGACY_FLAGS = (("cls", "pooling_mode_cls_token"), ("max", "pooling_mode_max_tokens"),
                 ("mean", "pooling_mode_mean_tokens"), ("mean_sqrt_len", "pooling_mode_mean_sqrt_len_tokens"),
                 ("weightedmean", "pooling_mode_weightedmean_tokens"), ("lasttoken", "pooling_mode_lasttoken"))
"""Older sentence-transformers' Pooling flags, in the order it concatenates the modes."""
_MODE_NAMES = {"mean_sqrt_len_tokens": "mean_sqrt_len"}
"""sentence-transformers' `pooling_mode` names that differ from ours."""
_DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh"}
_MASKED = -1e9
"""Given to max-pooling's inputs at padding: below any state."""
ModelConfig = Union[encoder.EncoderConfig, decoder_embedder.DecoderEmbedderConfig]


@dataclasses.dataclass(frozen=True)
class Pooling:
    """How token states become one vector: the Pooling module (+ Normalize)."""

    modes: tuple[str, ...]
    """Some of POOLING_MODES; several are concatenated in this order, as sentence-transformers does."""
    normalize: bool
    """L2-normalise the final vector (modules.json ends with a Normalize module)."""


@dataclasses.dataclass(frozen=True)
class DenseSpec:
    """One Dense module: its folder (config.json, model.safetensors with linear.weight [out, in])."""

    folder: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str
    """"identity" or "tanh"."""


@dataclasses.dataclass(frozen=True)
class SentenceCheckpoint:
    """Where a sentence-transformers checkpoint keeps its parts, and what they say."""

    transformer_dir: Path
    """The Transformer module's folder: config.json, *.safetensors."""
    config: ModelConfig
    pooling: Pooling
    dense: tuple[DenseSpec, ...]
    max_seq_length: Optional[int]
    """sentence_bert_config.json's max_seq_length, if it has one."""

    @property
    def dimensions(self) -> int:
        return self.dense[-1].out_features if self.dense else self.config.hidden_size * len(self.pooling.modes)


def read_checkpoint(model_dir: str | Path) -> SentenceCheckpoint:
    """Read modules.json, the modules' configs, sentence_bert_config.json and config.json (no weights)."""
    root = Path(model_dir).expanduser().absolute()
    modules = _read_modules(root)
    kinds = [kind for kind, _ in modules]
    transformer_dir = root / next((path for kind, path in modules if kind == "Transformer"), "")
    config = model_config(read_hf_config(transformer_dir), transformer_dir)
    if "Pooling" in kinds:
        modes = _read_pooling_modes(root / modules[kinds.index("Pooling")][1], config.hidden_size)
    else:
        modes = ("lasttoken",) if isinstance(config, decoder_embedder.DecoderEmbedderConfig) and \
            not config.bidirectional else ("mean",)
        logger.warning("%s has no sentence-transformers Pooling module: pooling by %s", root, modes[0])
    width = config.hidden_size * len(modes)
    dense = []
    for kind, path in modules:
        if kind == "Dense":
            dense.append(_read_dense(root / path, width))
            width = dense[-1].out_features
    st_config = transformer_dir / "sentence_bert_config.json"
    max_seq_length = json.loads(st_config.read_text()).get("max_seq_length") if st_config.is_file() else None
    return SentenceCheckpoint(transformer_dir, config, Pooling(modes, "Normalize" in kinds), tuple(dense),
                              max_seq_length)


def model_config(hf: dict, where: Path) -> ModelConfig:
    """The transformer's config of a config.json whose model_type the engine runs."""
    family = hf.get("model_type")
    if family in encoder.FAMILIES:
        return encoder.encoder_config(hf, where)
    if family in decoder_embedder.FAMILIES:
        return decoder_embedder.decoder_config(hf, where)
    raise ValueError(f"model_type {family!r} in {where}/config.json is not supported by the embedding engine; it "
                     f"runs BERT-family encoders ({', '.join(encoder.FAMILIES)}) and decoder embedders "
                     f"({', '.join(decoder_embedder.FAMILIES)})")


_ORDER = ("Transformer", "Pooling", "Dense", "Normalize")


def _read_modules(root: Path) -> list[tuple[str, str]]:
    """modules.json as (module class name, its folder) in order; [] when there is none (a plain HF
    checkpoint). The modules must come in _ORDER (Dense repeated or absent)."""
    path = root / "modules.json"
    if not path.is_file():
        return []
    modules = []
    for module in json.loads(path.read_text()):
        kind = module["type"].rsplit(".", 1)[-1]
        if kind not in _ORDER:
            raise ValueError(f"{path} has a {module['type']} module; the embedding engine runs only "
                             f"{', '.join(_ORDER)} modules: use a model without it")
        modules.append((kind, module.get("path", "")))
    ranks = [_ORDER.index(kind) for kind, _ in modules]
    if ranks != sorted(ranks) or any(ranks.count(r) > 1 for r in (0, 1, 3)):
        raise ValueError(f"{path} lists {', '.join(k for k, _ in modules)}; the embedding engine runs one Transformer, "
                         "one Pooling, any Dense modules and one Normalize, in that order")
    return modules


def _read_pooling_modes(folder: Path, hidden_size: int) -> tuple[str, ...]:
    """The Pooling config's modes: its `pooling_mode` (a name or a list, in order) or, as older
    sentence-transformers write it, its `pooling_mode_*` flags."""
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json; a sentence-transformers Pooling module needs one")
    config = json.loads(path.read_text())
    if "pooling_mode" in config:
        named = config["pooling_mode"]
        modes = tuple(_MODE_NAMES.get(m, m) for m in ([named] if isinstance(named, str) else named))
    else:
        modes = tuple(m for m, flag in _LEGACY_FLAGS if config.get(flag)) or ("mean",)
    unsupported = [m for m in modes if m not in POOLING_MODES]
    if unsupported:
        raise ValueError(f"{path} asks for pooling by {', '.join(unsupported)}; the embedding engine pools by "
                         f"{', '.join(POOLING_MODES)} only")
    dimension = config.get("embedding_dimension", config.get("word_embedding_dimension", hidden_size))
    if dimension != hidden_size:
        raise ValueError(f"{path} has word_embedding_dimension {dimension}, but the model's hidden_size is "
                         f"{hidden_size}; fix the Pooling config")
    return modes


def _read_dense(folder: Path, width: int) -> DenseSpec:
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json; a sentence-transformers Dense module needs one")
    config = json.loads(path.read_text())
    activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    if activation not in _DENSE_ACTIVATIONS:
        raise ValueError(f"{path} has activation_function {activation!r}; the embedding engine runs Dense modules "
                         f"with {' or '.join(_DENSE_ACTIVATIONS)}")
    if config.get("module_input_name", "sentence_embedding") != "sentence_embedding":
        raise ValueError(f"{path} reads {config['module_input_name']!r}; the embedding engine runs Dense modules "
                         "over the pooled sentence_embedding only")
    if config["in_features"] != width:
        raise ValueError(f"{path} has in_features {config['in_features']}, but the module before it makes {width} "
                         "values; fix the Dense config")
    return DenseSpec(folder, config["in_features"], config["out_features"], bool(config.get("bias", True)),
                     _DENSE_ACTIVATIONS[activation])


# ---- the model ----


class Dense(eqx.Module):
    weight: jax.Array
    """float32 [in, out]"""
    bias: Optional[jax.Array]
    activation: str = eqx.field(static=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.weight + (0.0 if self.bias is None else self.bias)
        return jnp.tanh(y) if self.activation == "tanh" else y


class SentenceEncoder(eqx.Module):
    transformer: eqx.Module
    """An engine.models.encoder.Encoder or decoder_embedder.DecoderEmbedder: (tokens, mask) -> states."""
    dense: tuple[Dense, ...]
    pooling: Pooling = eqx.field(static=True)


def pool(hidden: hax.NamedArray, mask: hax.NamedArray, modes: tuple[str, ...]) -> jax.Array:
    """[batch, position, embed] states -> [batch, embed x len(modes)] float32, over the tokens `mask`
    keeps (left-aligned). As sentence-transformers computes it: a row without tokens (batch padding)
    pools to zeros."""
    hidden = hidden.astype(jnp.float32)
    weights = mask.astype(jnp.float32)
    count = hax.maximum(hax.sum(weights, Pos), 1e-9)
    total = hax.sum(hidden * weights, Pos)
    pooled = {
        "cls": lambda: hidden[Pos, 0],
        "max": lambda: hax.max(hax.where(mask, hidden, _MASKED), Pos),
        "mean": lambda: total / count,
        "mean_sqrt_len": lambda: total / hax.sqrt(count),
        "lasttoken": lambda: _last_token(hidden, mask),
    }
    return jnp.concatenate([pooled[m]().rearrange(("batch", "embed")).array for m in modes], axis=1)


def _last_token(hidden: hax.NamedArray, mask: hax.NamedArray) -> hax.NamedArray:
    """Each row's state at its last masked-in token."""
    last = jnp.maximum(jnp.sum(mask.rearrange(("batch", Pos)).array, axis=1) - 1, 0)
    states = hidden.rearrange(("batch", Pos, "embed")).array
    return hax.named(states[jnp.arange(states.shape[0]), last], ("batch", "embed"))


def embed(model: SentenceEncoder, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """tokens int32 [batch, position], mask bool [batch, position] (left-aligned) -> float32 [batch,
    dimensions]: the transformer's states pooled, through the Dense modules, normalised if it says."""
    hidden = model.transformer(hax.named(tokens, ("batch", Pos)), hax.named(mask, ("batch", Pos)))
    out = pool(hidden, hax.named(mask, ("batch", Pos)), model.pooling.modes)
    for dense in model.dense:
        out = dense(out)
    if model.pooling.normalize:
        out = out / jnp.maximum(jnp.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out


# ---- loading ----


def load_model(checkpoint: SentenceCheckpoint, dtype: str) -> SentenceEncoder:
    """The checkpoint's transformer in `dtype` ("float32" or "bfloat16"), its Dense modules in float32."""
    config = checkpoint.config
    if isinstance(config, encoder.EncoderConfig):
        transformer = encoder.load_encoder(checkpoint.transformer_dir, config, dtype)
    else:
        transformer = decoder_embedder.load_decoder_embedder(checkpoint.transformer_dir, config, dtype)
    return SentenceEncoder(transformer, tuple(_load_dense(spec) for spec in checkpoint.dense), checkpoint.pooling)


def _load_dense(spec: DenseSpec) -> Dense:
    path = spec.folder / "model.safetensors"
    if not path.is_file():
        raise ValueError(f"{spec.folder} has no model.safetensors; the embedding engine reads a Dense module's "
                         "weights from safetensors only")
    state = load_file(path)
    weight = state["linear.weight"]
    if weight.shape != (spec.out_features, spec.in_features):
        raise ValueError(f"{path}'s linear.weight is {weight.shape}, not (out_features, in_features) = "
                         f"({spec.out_features}, {spec.in_features}) as its config.json says")
    bias = jnp.asarray(state["linear.bias"], jnp.float32) if spec.bias else None
    return Dense(jnp.asarray(weight.T, jnp.float32), bias, spec.activation)
