"""Decoder-shaped sentence encoders, one whole forward pass over a padded batch (no KV cache):
EmbeddingGemma (`gemma3_text` with `use_bidirectional_attention`) and Qwen3-Embedding (`qwen3`).

Both are pre-norm decoder stacks with grouped-query attention, RMS-normed queries and keys, RoPE
(engine.layers.rope) and a gated MLP, then a final RMSNorm; what differs is read from config.json:
- Gemma 3: embeddings scaled by sqrt(hidden_size) (rounded to their dtype), RMSNorms scaled by
  1 + weight, a norm after attention and around the MLP too ("sandwich"), scores scaled by
  query_pre_attn_scalar ** -0.5, `gelu_pytorch_tanh`; sliding layers (engine.models.variant's
  layer types) rotate with `rope_local_base_freq`. With bidirectional attention a query sees every
  key, and in a sliding layer the keys less than w = sliding_window // 2 + 1 positions away on
  either side (transformers' Gemma3TextConfig halves config.json's window, and its
  _bidirectional_window_overlay allows |i - j| < w); otherwise the earlier keys (causal, as Qwen3).
- Qwen3: RMSNorms scaled by weight, scores by head_dim ** -0.5, `silu`, causal attention.
Padding keys are masked; rows are right-padded here and positions count from 0 at each row's first
token. A left-padded reference (Qwen3-Embedding's tokenizer) numbers them from the padding on, but
RoPE's scores depend only on the distance between positions, so its rows are the same.

`hidden_states(model, tokens, mask)`: [batch, position] -> the final norm's output [batch, position,
embed]. Named axes: "batch", "position", "key_position", "embed", "kv_heads", "q_per_kv",
"head_size", "mlp". In bfloat16 the norms, the scores and the softmax run in float32.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Optional

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp

from engine.formats.checkpoint_config import declared_dtype
from engine.layers.rope import Rope, rotate
from engine.layers.transformer import ACTIVATIONS, MASKED_SCORE, KPos, Pos, TorchWeights
from engine.models.encoder import read_state_dict
from engine.models.variant import layer_types

logger = logging.getLogger(__name__)

Batch = "batch"
FAMILIES = ("gemma3_text", "qwen3")
"""config.json model types served here."""
_ACTIVATIONS = {**ACTIVATIONS, "silu": hnn.silu}


@dataclasses.dataclass(frozen=True)
class DecoderEmbedderConfig:
    """What the forward pass needs of a `gemma3_text` / `qwen3` config.json."""

    family: str
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    activation: str
    max_position_embeddings: int
    dtype: str
    bidirectional: bool
    attention_bias: bool
    query_scale: float
    sliding_window: Optional[int]
    sliding_layers: tuple[bool, ...]
    """Per layer: whether it attends over the sliding window."""
    rope: Rope
    local_rope: Optional[Rope]
    """The sliding layers' RoPE (Gemma 3); None: every layer rotates with `rope`."""

    @property
    def gemma(self) -> bool:
        return self.family == "gemma3_text"

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings


def decoder_config(hf: dict, where: Path) -> DecoderEmbedderConfig:
    """The config of a `gemma3_text` or `qwen3` config.json (read by read_hf_config from `where`)."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r} in {where}/config.json is not a decoder embedder "
                         f"({', '.join(FAMILIES)})")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    activation = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{where}/config.json has hidden activation {activation!r}; the embedding engine supports "
                         f"{', '.join(_ACTIVATIONS)}")
    gemma = family == "gemma3_text"
    sliding = tuple(kind == "sliding_attention" for kind in layer_types(hf))
    local = None
    if gemma and any(sliding):
        local = Rope.from_hf_config({**hf, "rope_theta": hf.get("rope_local_base_freq", 10000.0),
                                     "rope_scaling": None}, head_dim)
    scalar = hf.get("query_pre_attn_scalar", head_dim) if gemma else head_dim
    return DecoderEmbedderConfig(
        family=family, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_heads=hf["num_attention_heads"], num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=head_dim, intermediate_size=hf["intermediate_size"], rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        activation=activation, max_position_embeddings=hf["max_position_embeddings"], dtype=declared_dtype(hf),
        bidirectional=bool(hf.get("use_bidirectional_attention", False)),
        attention_bias=bool(hf.get("attention_bias", False)), query_scale=float(scalar) ** -0.5,
        sliding_window=_window(hf) if any(sliding) else None, sliding_layers=sliding,
        rope=Rope.from_hf_config(hf, head_dim), local_rope=local)


def _window(hf: dict) -> int:
    """The sliding layers' window as transformers 4 loads config.json: bidirectional Gemma 3 halves it
    (`sliding_window // 2 + 1`, its Gemma3TextConfig's exclusive bound on |query - key|)."""
    window = hf["sliding_window"]
    return window // 2 + 1 if hf["model_type"] == "gemma3_text" and hf.get("use_bidirectional_attention") else window


# ---- the model ----


class RmsNorm(eqx.Module):
    weight: hax.NamedArray
    eps: float = eqx.field(static=True)
    offset: float = eqx.field(static=True)
    """1.0 for Gemma's (1 + weight) scale, 0.0 for Qwen's."""

    def __call__(self, x: hax.NamedArray, axis: str) -> hax.NamedArray:
        """x normalised over `axis` in float32, scaled, returned in x's dtype."""
        x32 = x.astype(jnp.float32)
        normed = x32 * hax.rsqrt(hax.mean(x32 * x32, axis) + self.eps)
        return (normed * (self.offset + self.weight.astype(jnp.float32))).astype(x.dtype)


class Attention(eqx.Module):
    q: hnn.Linear
    """embed -> (kv_heads, q_per_kv, head_size): query head h reads KV head h // q_per_kv."""
    k: hnn.Linear
    v: hnn.Linear
    o: hnn.Linear
    q_norm: RmsNorm
    k_norm: RmsNorm
    scale: float = eqx.field(static=True)

    def __call__(self, x: hax.NamedArray, allowed: hax.NamedArray, rope: tuple, Head: hax.Axis) -> hax.NamedArray:
        """x [batch, position, embed]; allowed: bool [batch, position, key_position]."""
        q = rotate(self.q_norm(self.q(x), "head_size"), rope, Head)
        k = rotate(self.k_norm(self.k(x), "head_size"), rope, Head).rename({Pos: KPos})
        v = self.v(x).rename({Pos: KPos})
        scores = hax.dot(q, k, axis="head_size", preferred_element_type=jnp.float32) * self.scale
        weights = hnn.softmax(hax.where(allowed, scores, MASKED_SCORE), axis=KPos).astype(v.dtype)
        return self.o(hax.dot(weights, v, axis=KPos))


class Layer(eqx.Module):
    attention: Attention
    gate: hnn.Linear
    up: hnn.Linear
    down: hnn.Linear
    norms: tuple[RmsNorm, ...]
    """Gemma: input, post-attention, pre-MLP, post-MLP; Qwen3: input, post-attention (= pre-MLP)."""
    slides: bool = eqx.field(static=True)
    activation: str = eqx.field(static=True)

    def __call__(self, x: hax.NamedArray, allowed: hax.NamedArray, rope: tuple, Head: hax.Axis) -> hax.NamedArray:
        attended = self.attention(self._norm(0, x), allowed, rope, Head)
        if len(self.norms) == 2:
            x = x + attended
            return x + self._mlp(self._norm(1, x))
        x = x + self._norm(1, attended)
        return x + self._norm(3, self._mlp(self._norm(2, x)))

    def _norm(self, index: int, x: hax.NamedArray) -> hax.NamedArray:
        return self.norms[index](x, "embed")

    def _mlp(self, x: hax.NamedArray) -> hax.NamedArray:
        return self.down(_ACTIVATIONS[self.activation](self.gate(x)) * self.up(x))


class DecoderEmbedder(eqx.Module):
    embed_tokens: hax.NamedArray
    """[vocab, embed]"""
    layers: tuple[Layer, ...]
    norm: RmsNorm
    config: DecoderEmbedderConfig = eqx.field(static=True)

    def __call__(self, tokens: hax.NamedArray, mask: hax.NamedArray) -> hax.NamedArray:
        """tokens, mask: [batch, position] (right-padded) -> final states [batch, position, embed]."""
        c = self.config
        x = self.embed_tokens.take("vocab", tokens)
        if c.gemma:
            x = x * jnp.asarray(c.hidden_size ** 0.5, x.dtype)
        positions = hax.arange(tokens.resolve_axis(Pos))
        Head = hax.Axis("head_size", c.head_dim)
        tables = c.rope.tables(positions)
        local_tables = c.local_rope.tables(positions) if c.local_rope else tables
        full, sliding = self._allowed(mask, positions, sliding=False), self._allowed(mask, positions, sliding=True)
        for layer in self.layers:
            x = layer(x, sliding if layer.slides else full, local_tables if layer.slides else tables, Head)
        return self.norm(x, "embed")

    def _allowed(self, mask: hax.NamedArray, positions: hax.NamedArray, *, sliding: bool) -> hax.NamedArray:
        """bool [batch, position, key_position]: the keys each query attends to."""
        Position = positions.resolve_axis(Pos)
        # query position i minus key position j
        distance = hax.named(positions.array[:, None] - positions.array[None, :], (Position, Position.alias(KPos)))
        allowed = mask.rename({Pos: KPos}).broadcast_axis(Position)
        if not self.config.bidirectional:
            allowed = allowed & (distance >= 0)
        window = self.config.sliding_window
        if sliding and window is not None:
            allowed = allowed & ((hax.abs(distance) if self.config.bidirectional else distance) < window)
        return allowed


def hidden_states(model: DecoderEmbedder, tokens: jax.Array, mask: jax.Array) -> hax.NamedArray:
    """tokens int32 [batch, position], mask bool [batch, position] (True at each row's first tokens)
    -> the final norm's states [batch, position, embed], in the weights' dtype."""
    return model(hax.named(tokens, (Batch, Pos)), hax.named(mask, (Batch, Pos)))


# ---- loading ----


def load_decoder_embedder(folder: Path, config: DecoderEmbedderConfig, dtype: str) -> DecoderEmbedder:
    """The model saved in `folder` (*.safetensors of a Gemma3TextModel / Qwen3Model, or of a
    ...ForCausalLM under `model.`; the LM head is ignored) in `dtype`."""
    state = read_state_dict(folder, ("model.",), "embed_tokens.weight", "a Gemma 3 / Qwen3 checkpoint")
    weights = TorchWeights(state.__getitem__, jnp.dtype(dtype))
    Embed = hax.Axis("embed", config.hidden_size)
    layers = tuple(_load_layer(weights, i, config, Embed) for i in range(len(config.sliding_layers)))
    model = DecoderEmbedder(weights.array("embed_tokens.weight", (hax.Axis("vocab", config.vocab_size), Embed)),
                            layers, _norm(weights, "norm", Embed, config), config)
    logger.info("loaded %s embedder %s (%d layers, hidden %d, %s)", config.family, folder, len(layers),
                config.hidden_size, dtype)
    return model


def _load_layer(weights: TorchWeights, index: int, c: DecoderEmbedderConfig, Embed: hax.Axis) -> Layer:
    p = f"layers.{index}"
    KV, Head = hax.Axis("kv_heads", c.num_kv_heads), hax.Axis("head_size", c.head_dim)
    Q = (KV, hax.Axis("q_per_kv", c.num_heads // c.num_kv_heads), Head)
    bias = c.attention_bias
    attention = Attention(
        q=weights.linear(f"{p}.self_attn.q_proj", Embed, Q, bias=bias),
        k=weights.linear(f"{p}.self_attn.k_proj", Embed, (KV, Head), bias=bias),
        v=weights.linear(f"{p}.self_attn.v_proj", Embed, (KV, Head), bias=bias),
        o=weights.linear(f"{p}.self_attn.o_proj", Q, Embed, bias=bias),
        q_norm=_norm(weights, f"{p}.self_attn.q_norm", Head, c),
        k_norm=_norm(weights, f"{p}.self_attn.k_norm", Head, c),
        scale=c.query_scale)
    names = ("input_layernorm", "post_attention_layernorm")
    if c.gemma:
        names += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    Mlp = hax.Axis("mlp", c.intermediate_size)
    return Layer(attention, weights.linear(f"{p}.mlp.gate_proj", Embed, Mlp, bias=False),
                 weights.linear(f"{p}.mlp.up_proj", Embed, Mlp, bias=False),
                 weights.linear(f"{p}.mlp.down_proj", Mlp, Embed, bias=False),
                 tuple(_norm(weights, f"{p}.{n}", Embed, c) for n in names),
                 slides=c.sliding_layers[index], activation=c.activation)


def _norm(weights: TorchWeights, prefix: str, axis: hax.Axis, c: DecoderEmbedderConfig) -> RmsNorm:
    return RmsNorm(weights.array(f"{prefix}.weight", (axis,)), c.rms_norm_eps, 1.0 if c.gemma else 0.0)
