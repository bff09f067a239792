"""A BERT-family sentence encoder in haliax + equinox: the model behind `/v1/embeddings`.

Reads a sentence-transformers checkpoint directory:
  * modules.json: a `Transformer` module (a Hugging Face `BertModel`: config.json and safetensors
    weights, in the module's path, usually the root), a `Pooling` module (its folder's config.json)
    and optionally a `Normalize` module. Without modules.json the model is pooled as
    sentence-transformers pools a plain Hugging Face checkpoint: the mean of its tokens, unnormalised.
  * sentence_bert_config.json: `max_seq_length`, the longest input the model was trained for.

The forward pass is BERT's: word + position + token-type-0 embeddings and a LayerNorm, then
engine.layers.transformer's encoder layers, post-norm (bidirectional self-attention and a GELU
feed-forward block, each followed by a residual LayerNorm), q scaled before its dot with the keys.
Padding is masked out of attention and pooling, so a row's embedding does not depend on what else
shares its batch or how far it is padded.

Named axes: "batch", "vocab" and the layers' ("position", "key_position", "embed", ...). Weights are
stored (In..., Out...), as `loading.inputs_first` lays out the decoder's, so no call transposes a
weight. In bfloat16, the LayerNorm statistics, the softmax and the pooling run in float32; the
output is always float32.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Optional

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from engine.formats.checkpoint_config import declared_dtype, read_hf_config
from engine.layers.transformer import (
    EncoderLayer,
    EncoderSizes,
    KPos,
    LayerAxes,
    LayerKeys,
    Pos,
    TorchWeights,
    layer_norm,
    load_encoder_layer,
)

logger = logging.getLogger(__name__)

Batch = "batch"
_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")
"""BERT's `hidden_act` values served (plain `gelu` is erf's GELU, the two others its tanh approximation)."""
_POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len")
"""The pooling modes served, in the order sentence-transformers concatenates them."""
_MASKED = -1e9
"""Given to max-pooling's inputs at padding: below any state."""


@dataclasses.dataclass(frozen=True)
class EncoderConfig(EncoderSizes):
    """The sizes of a BERT encoder, from its config.json."""

    vocab_size: int
    max_position_embeddings: int
    dtype: str
    """The weights' dtype as config.json declares it (engine.formats.checkpoint_config.declared_dtype)."""


@dataclasses.dataclass(frozen=True)
class Pooling:
    """How token states become one vector: the sentence-transformers Pooling (+ Normalize) modules."""

    modes: tuple[str, ...]
    """Some of `_POOLING_MODES`, in that order; several are concatenated, as sentence-transformers does."""
    normalize: bool
    """L2-normalise the pooled vector (modules.json has a Normalize module)."""


@dataclasses.dataclass(frozen=True)
class EncoderCheckpoint:
    """Where a sentence-transformers checkpoint keeps its parts, and what they say."""

    transformer_dir: Path
    """The Transformer module's folder: config.json, *.safetensors."""
    config: EncoderConfig
    pooling: Pooling
    max_seq_length: Optional[int]
    """sentence_bert_config.json's max_seq_length, if it has one."""

    @property
    def dimensions(self) -> int:
        return self.config.hidden_size * len(self.pooling.modes)


def read_checkpoint(model_dir: str | Path) -> EncoderCheckpoint:
    """Read modules.json, the pooling config, sentence_bert_config.json and config.json (no weights)."""
    root = Path(model_dir).expanduser().absolute()
    modules = _read_modules(root)
    transformer_dir = root / modules.get("Transformer", "")
    config = _encoder_config(read_hf_config(transformer_dir), transformer_dir)
    normalize = "Normalize" in modules
    if "Pooling" in modules:
        pooling = Pooling(_read_pooling_modes(root / modules["Pooling"], config.hidden_size), normalize)
    else:
        logger.warning("%s has no sentence-transformers Pooling module: pooling by the mean of the tokens", root)
        pooling = Pooling(("mean",), normalize)
    st_config = transformer_dir / "sentence_bert_config.json"
    max_seq_length = json.loads(st_config.read_text()).get("max_seq_length") if st_config.is_file() else None
    return EncoderCheckpoint(transformer_dir, config, pooling, max_seq_length)


def _read_modules(root: Path) -> dict[str, str]:
    """modules.json as {module class name: its folder}; {} when there is none (a plain HF checkpoint)."""
    path = root / "modules.json"
    if not path.is_file():
        return {}
    modules = {}
    for module in json.loads(path.read_text()):
        kind = module["type"].rsplit(".", 1)[-1]
        if kind not in ("Transformer", "Pooling", "Normalize"):
            raise ValueError(f"{path} has a {module['type']} module; the embedding engine runs only "
                             "Transformer, Pooling and Normalize modules: use a model without it")
        modules[kind] = module.get("path", "")
    return modules


def _encoder_config(hf: dict, where: Path) -> EncoderConfig:
    if hf.get("model_type") != "bert":
        raise ValueError(f"model_type {hf.get('model_type')!r} in {where}/config.json is not supported by the "
                         "embedding engine; it runs BERT-family encoders (model_type 'bert')")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{where}/config.json has position_embedding_type {hf['position_embedding_type']!r}; "
                         "the embedding engine supports 'absolute' only")
    if hf.get("hidden_act", "gelu") not in _ACTIVATIONS:
        raise ValueError(f"{where}/config.json has hidden_act {hf['hidden_act']!r}; the embedding engine "
                         f"supports {', '.join(_ACTIVATIONS)}")
    return EncoderConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 512),
        layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        hidden_act=hf.get("hidden_act", "gelu"),
        dtype=declared_dtype(hf),
    )


def _read_pooling_modes(folder: Path, hidden_size: int) -> tuple[str, ...]:
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json; a sentence-transformers Pooling module needs one")
    config = json.loads(path.read_text())
    unsupported = [k for k in ("pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken") if config.get(k)]
    if unsupported:
        raise ValueError(f"{path} asks for {', '.join(unsupported)}; the embedding engine pools by "
                         f"{', '.join(_POOLING_MODES)} only")
    modes = tuple(m for m in _POOLING_MODES if config.get("pooling_mode_cls_token" if m == "cls" else
                                                          f"pooling_mode_{m}_tokens"))
    if not modes:
        raise ValueError(f"{path} sets no pooling_mode_*; set one of pooling_mode_mean_tokens, "
                         "pooling_mode_cls_token, pooling_mode_max_tokens, pooling_mode_mean_sqrt_len_tokens")
    dimension = config.get("word_embedding_dimension", hidden_size)
    if dimension != hidden_size:
        raise ValueError(f"{path} has word_embedding_dimension {dimension}, but the model's hidden_size is "
                         f"{hidden_size}; fix the Pooling config")
    return modes


# ---- the model ----


class Embeddings(eqx.Module):
    word: hax.NamedArray
    """[vocab, embed]"""
    position: hax.NamedArray
    """[position, embed], position sized max_position_embeddings; sliced to the input's length."""
    token_type: hax.NamedArray
    """[embed]: the row of token type 0 (every input is one segment)."""
    norm: hnn.LayerNorm

    def __call__(self, tokens: hax.NamedArray) -> hax.NamedArray:
        positions = self.position[Pos, : tokens.resolve_axis(Pos).size]
        return layer_norm(self.norm, self.word.take("vocab", tokens) + positions + self.token_type)


class Encoder(eqx.Module):
    embeddings: Embeddings
    layers: tuple[EncoderLayer, ...]
    """Post-norm, q scaled before its dot with the keys, padding keys masked."""

    def __call__(self, tokens: hax.NamedArray, mask: hax.NamedArray) -> hax.NamedArray:
        """tokens, mask: [batch, position] -> last hidden states [batch, position, embed]."""
        x = self.embeddings(tokens)
        key_mask = mask.rename({Pos: KPos})
        for layer in self.layers:
            x = layer(x, key_mask)
        return x


def pool(hidden: hax.NamedArray, mask: hax.NamedArray, pooling: Pooling) -> jax.Array:
    """[batch, position, embed] states -> [batch, dimensions] float32, over the tokens `mask` keeps.

    As sentence-transformers computes it: a row without tokens (batch padding) pools to zeros.
    """
    hidden = hidden.astype(jnp.float32)
    weights = mask.astype(jnp.float32)
    count = hax.maximum(hax.sum(weights, Pos), 1e-9)
    total = hax.sum(hidden * weights, Pos)
    pooled = {
        "cls": lambda: hidden[Pos, 0],
        "max": lambda: hax.max(hax.where(mask, hidden, _MASKED), Pos),
        "mean": lambda: total / count,
        "mean_sqrt_len": lambda: total / hax.sqrt(count),
    }
    out = jnp.concatenate([pooled[m]().rearrange((Batch, "embed")).array for m in pooling.modes], axis=1)
    if pooling.normalize:
        out = out / jnp.maximum(jnp.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out


def embed(model: Encoder, tokens: jax.Array, mask: jax.Array, pooling: Pooling) -> jax.Array:
    """tokens int32 [batch, position], mask bool [batch, position] -> float32 [batch, dimensions]."""
    tokens = hax.named(tokens, (Batch, Pos))
    mask = hax.named(mask, (Batch, Pos))
    return pool(model(tokens, mask), mask, pooling)


# ---- loading ----


def load_encoder(checkpoint: EncoderCheckpoint, dtype: str) -> Encoder:
    """The encoder of `checkpoint` with its weights in `dtype` ("float32" or "bfloat16")."""
    state = _read_state_dict(checkpoint.transformer_dir)
    config, weights = checkpoint.config, TorchWeights(state.__getitem__, jnp.dtype(dtype))
    embed = LayerAxes.of(config).embed
    embeddings = Embeddings(
        word=weights.array("embeddings.word_embeddings.weight", (hax.Axis("vocab", config.vocab_size), embed)),
        position=weights.array("embeddings.position_embeddings.weight",
                               (hax.Axis(Pos, config.max_position_embeddings), embed)),
        token_type=hax.named(jnp.asarray(state["embeddings.token_type_embeddings.weight"][0], weights.dtype),
                             (embed,)),
        norm=weights.norm("embeddings.LayerNorm", embed, config.layer_norm_eps),
    )
    layers = tuple(load_encoder_layer(weights, _layer_keys(i), config, pre_norm=False, scale_query=True)
                   for i in range(config.num_layers))
    model = Encoder(embeddings, layers)
    logger.info("loaded BERT encoder %s (%d layers, hidden %d, %s)", checkpoint.transformer_dir,
                config.num_layers, config.hidden_size, dtype)
    return model


def _layer_keys(i: int) -> LayerKeys:
    """Where `BertModel` keeps layer i's weights."""
    p = f"encoder.layer.{i}"
    return LayerKeys(query=f"{p}.attention.self.query", key=f"{p}.attention.self.key",
                     value=f"{p}.attention.self.value", out=f"{p}.attention.output.dense",
                     attn_norm=f"{p}.attention.output.LayerNorm", up=f"{p}.intermediate.dense",
                     down=f"{p}.output.dense", mlp_norm=f"{p}.output.LayerNorm")


def _read_state_dict(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder's *.safetensors files, named as in `BertModel` (a `bert.` prefix,
    as `BertFor...` heads save it, is dropped; heads and the pooler are ignored)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weights; the embedding engine reads safetensors only "
                         "(convert pytorch_model.bin with transformers: from_pretrained, then save_pretrained)")
    state: dict[str, np.ndarray] = {}
    for file in files:
        state.update(load_file(file))
    if "bert.embeddings.word_embeddings.weight" in state:
        state = {k.removeprefix("bert."): v for k, v in state.items()}
    if "embeddings.word_embeddings.weight" not in state:
        raise ValueError(f"{folder} has no embeddings.word_embeddings.weight: not a BertModel checkpoint")
    return state
