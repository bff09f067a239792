"""A BERT-family sentence encoder in haliax + equinox: the model behind `/v1/embeddings`.

Reads a sentence-transformers checkpoint directory:
  * modules.json: a `Transformer` module (a Hugging Face `BertModel`: config.json and safetensors
    weights, in the module's path, usually the root), a `Pooling` module (its folder's config.json)
    and optionally a `Normalize` module. Without modules.json the model is pooled as
    sentence-transformers pools a plain Hugging Face checkpoint: the mean of its tokens, unnormalised.
  * sentence_bert_config.json: `max_seq_length`, the longest input the model was trained for.

The forward pass is BERT's: word + position + token-type-0 embeddings and a LayerNorm, then layers
of bidirectional self-attention and a GELU feed-forward block, each followed by a residual
LayerNorm (post-norm). Padding is masked out of attention and pooling, so a row's embedding does
not depend on what else shares its batch or how far it is padded.

Named axes: "batch", "position" (and "key_position" inside attention), "embed", "qkv", "heads",
"head_size", "mlp", "vocab". Weights are stored (In..., Out...), as `loading.inputs_first` lays
out the decoder's, so no call transposes a weight. In bfloat16, the LayerNorm statistics, the
softmax and the pooling run in float32; the output is always float32.
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

logger = logging.getLogger(__name__)

Batch, Pos, KPos = "batch", "position", "key_position"
_ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}
"""BERT's `hidden_act` -> whether it is the tanh approximation of GELU (plain `gelu` is erf's)."""
_POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len")
"""The pooling modes served, in the order sentence-transformers concatenates them."""
_MASKED = -1e9
"""Added to masked attention scores and max-pooling inputs: exp() of it is 0 in float32."""


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """The sizes of a BERT encoder, from its config.json."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    layer_norm_eps: float
    hidden_act: str
    dtype: str
    """The weights' dtype as config.json declares it (engine.formats.checkpoint_config.declared_dtype)."""

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads


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
        return _layer_norm(self.norm, self.word.take("vocab", tokens) + positions + self.token_type)


class EncoderLayer(eqx.Module):
    qkv: hnn.Linear
    """embed -> (qkv, heads, head_size): query, key and value in one product."""
    attn_out: hnn.Linear
    attn_norm: hnn.LayerNorm
    up: hnn.Linear
    down: hnn.Linear
    ffn_norm: hnn.LayerNorm
    tanh_gelu: bool = eqx.field(static=True)

    def __call__(self, x: hax.NamedArray, mask: hax.NamedArray) -> hax.NamedArray:
        """x: [batch, position, embed]; mask: [batch, key_position], True for real tokens."""
        qkv = self.qkv(x)
        q, k, v = (qkv["qkv", i] for i in range(3))
        q = q * jnp.asarray(1.0 / np.sqrt(q.resolve_axis("head_size").size), q.dtype)
        k, v = k.rename({Pos: KPos}), v.rename({Pos: KPos})
        scores = hax.where(mask, hax.dot(q, k, axis="head_size").astype(jnp.float32), _MASKED)
        weights = hnn.softmax(scores, axis=KPos).astype(v.dtype)
        attended = hax.dot(weights, v, axis=KPos)
        x = _layer_norm(self.attn_norm, x + self.attn_out(attended))
        hidden = hnn.gelu(self.up(x), approximate=self.tanh_gelu)
        return _layer_norm(self.ffn_norm, x + self.down(hidden))


class Encoder(eqx.Module):
    embeddings: Embeddings
    layers: tuple[EncoderLayer, ...]

    def __call__(self, tokens: hax.NamedArray, mask: hax.NamedArray) -> hax.NamedArray:
        """tokens, mask: [batch, position] -> last hidden states [batch, position, embed]."""
        x = self.embeddings(tokens)
        key_mask = mask.rename({Pos: KPos})
        for layer in self.layers:
            x = layer(x, key_mask)
        return x


def _layer_norm(norm: hnn.LayerNorm, x: hax.NamedArray) -> hax.NamedArray:
    """`norm` with float32 statistics, returned in x's dtype."""
    return norm(x.astype(jnp.float32)).astype(x.dtype)


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
    config, dt = checkpoint.config, jnp.dtype(dtype)
    axes = _Axes.of(config)

    def array(name: str, names: tuple, shape: Optional[tuple] = None) -> hax.NamedArray:
        value = state[name] if shape is None else state[name].reshape(shape)
        return hax.named(jnp.asarray(value, dt), names)

    def linear(prefix: str, In, Out) -> hnn.Linear:
        in_shape = tuple(a.size for a in _spec(In))
        out_shape = tuple(a.size for a in _spec(Out))
        weight = state[f"{prefix}.weight"].T.reshape(in_shape + out_shape)  # torch keeps (out, in)
        return hnn.Linear(hax.named(jnp.asarray(weight, dt), (*_spec(In), *_spec(Out))),
                          array(f"{prefix}.bias", _spec(Out), out_shape), In, Out)

    def norm(prefix: str) -> hnn.LayerNorm:
        return hnn.LayerNorm(axes.embed, array(f"{prefix}.weight", (axes.embed,)),
                             array(f"{prefix}.bias", (axes.embed,)), eps=config.layer_norm_eps)

    def layer(i: int) -> EncoderLayer:
        p = f"encoder.layer.{i}"
        qkv_names = [f"{p}.attention.self.{n}" for n in ("query", "key", "value")]
        state[f"{p}.qkv.weight"] = np.concatenate([state[f"{n}.weight"] for n in qkv_names], axis=0)
        state[f"{p}.qkv.bias"] = np.concatenate([state[f"{n}.bias"] for n in qkv_names], axis=0)
        return EncoderLayer(
            qkv=linear(f"{p}.qkv", axes.embed, (axes.qkv, axes.heads, axes.head_size)),
            attn_out=linear(f"{p}.attention.output.dense", (axes.heads, axes.head_size), axes.embed),
            attn_norm=norm(f"{p}.attention.output.LayerNorm"),
            up=linear(f"{p}.intermediate.dense", axes.embed, axes.mlp),
            down=linear(f"{p}.output.dense", axes.mlp, axes.embed),
            ffn_norm=norm(f"{p}.output.LayerNorm"),
            tanh_gelu=_ACTIVATIONS[config.hidden_act],
        )

    embeddings = Embeddings(
        word=array("embeddings.word_embeddings.weight", (axes.vocab, axes.embed)),
        position=array("embeddings.position_embeddings.weight", (axes.positions, axes.embed)),
        token_type=hax.named(jnp.asarray(state["embeddings.token_type_embeddings.weight"][0], dt), (axes.embed,)),
        norm=norm("embeddings.LayerNorm"),
    )
    model = Encoder(embeddings, tuple(layer(i) for i in range(config.num_layers)))
    logger.info("loaded BERT encoder %s (%d layers, hidden %d, %s)", checkpoint.transformer_dir,
                config.num_layers, config.hidden_size, dtype)
    return model


@dataclasses.dataclass(frozen=True)
class _Axes:
    vocab: hax.Axis
    positions: hax.Axis
    embed: hax.Axis
    qkv: hax.Axis
    heads: hax.Axis
    head_size: hax.Axis
    mlp: hax.Axis

    @staticmethod
    def of(config: EncoderConfig) -> "_Axes":
        return _Axes(hax.Axis("vocab", config.vocab_size), hax.Axis(Pos, config.max_position_embeddings),
                     hax.Axis("embed", config.hidden_size), hax.Axis("qkv", 3), hax.Axis("heads", config.num_heads),
                     hax.Axis("head_size", config.head_size), hax.Axis("mlp", config.intermediate_size))


def _spec(axes) -> tuple[hax.Axis, ...]:
    return (axes,) if isinstance(axes, hax.Axis) else tuple(axes)


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
