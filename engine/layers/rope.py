"""Rotary position embeddings as transformers computes them, from config.json.

levanter's rotary modules are not used for serving: its Mistral config drops `rope_scaling`
entirely, and its YaRN differs from transformers' (positions divided by the factor, the correction
range over half the head, the attention factor's square root), so scaled checkpoints answered
differently. Here each type follows transformers' `modeling_rope_utils` (default, linear, llama3,
yarn, longrope; engine.formats.transformers_files refuses the others): the inverse frequencies and
the attention factor are computed once in numpy, and each step's cos and sin from the positions.

With `partial_rotary_factor` (Phi-4-mini) only the first part of each head rotates; the rest passes.
DeepSeek's latent attention rotates `qk_rope_head_dim` dimensions (engine.layers.latent_attention).
longrope (Phi-3's long-context checkpoints) has two sets of frequencies: a sequence longer than
`original_max_position_embeddings` rotates every token with the long ones, a shorter one with the
short ones, as transformers does (its generate recomputes the cache when a sequence grows past the
limit; the scheduler recomputes such a sequence too, and the planner says per row which set).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray


@dataclasses.dataclass(frozen=True)
class Rope:
    """One model's RoPE: cos and sin of position x inv_freq (each frequency twice: the rotated
    halves), scaled by `attention_factor` (yarn's; 1 otherwise)."""

    inv_freq: tuple[float, ...]
    attention_factor: float = 1.0
    long_inv_freq: tuple[float, ...] = ()
    """longrope's frequencies for sequences past its `original_max_position_embeddings` (empty: one set)."""

    @property
    def Head(self) -> hax.Axis:
        """The rotated part of a head (all of it unless `partial_rotary_factor` says less)."""
        return hax.Axis("head_size", 2 * len(self.inv_freq))

    @staticmethod
    def from_hf_config(config: dict, head_dim: int) -> "Rope":
        """`config`: config.json as engine.formats.transformers_files.hf_config reads it."""
        base = float(config.get("rope_theta", 10000.0))
        scaling = config.get("rope_scaling") or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        head_dim = config.get("qk_rope_head_dim") or int(head_dim * config.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        attention_factor = 1.0
        if kind == "longrope":
            return _longrope(config, scaling, base, head_dim)
        if kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind == "llama3":
            inv_freq = _llama3(inv_freq, scaling)
        elif kind == "yarn":
            inv_freq, attention_factor = _yarn(base, head_dim, scaling, config.get("max_position_embeddings"))
        elif kind != "default":
            raise ValueError(f"RoPE type {kind!r} is not implemented (engine.formats.transformers_files checks this)")
        return Rope(tuple(float(f) for f in inv_freq.astype(np.float32)), float(attention_factor))

    def tables(self, positions: NamedArray, long: Optional[jax.Array] = None) -> tuple[NamedArray, NamedArray]:
        """(cos, sin) f32 (position, head_size) for `rotate`; an optimization barrier keeps XLA from
        fusing them back into every layer's rotation. `long`: bool per token, whether its sequence
        rotates with longrope's long factors."""
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)[None, :]
        if self.long_inv_freq:
            inv_freq = jnp.where(long[:, None], jnp.asarray(self.long_inv_freq, jnp.float32)[None, :], inv_freq)
        freqs = positions.array.astype(jnp.float32)[:, None] * inv_freq
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        axes = (positions.axes[0], self.Head)
        cos = hax.named(jnp.cos(emb) * self.attention_factor, axes)
        sin = hax.named(jnp.sin(emb) * self.attention_factor, axes)
        return jax.lax.optimization_barrier((cos, sin))


def rotate(x: NamedArray, tables: tuple[NamedArray, NamedArray], Head: hax.Axis) -> NamedArray:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) for x's halves (x1, x2); with
    tables narrower than the head, its first part so and the rest as it is."""
    cos, sin = tables
    rotated = cos.resolve_axis(Head.name).size
    if rotated < Head.size:
        return hax.concatenate(Head.name, (rotate(x[Head, :rotated], tables, Head.resize(rotated)),
                                           x[Head, rotated:]))
    half = Head.size // 2
    rotated_half = hax.concatenate(Head, (-x[Head, half:], x[Head, :half]))
    return (x * cos + rotated_half * sin).astype(x.dtype)


def _longrope(config: dict, scaling: dict, base: float, dim: int) -> "Rope":
    """Phi-3's: short and long per-frequency factors; the attention factor from the ratio of
    `max_position_embeddings` to `original_max_position_embeddings` (as transformers computes it)."""
    original = config.get("original_max_position_embeddings")
    factor = config["max_position_embeddings"] / original if original else scaling.get("factor", 1.0)
    original = original or config["max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = np.arange(0, dim, 2, dtype=np.float64) / dim

    def inv_freq(factors) -> tuple[float, ...]:
        return tuple(float(f) for f in (1.0 / (np.asarray(factors, np.float64) * base ** shape)).astype(np.float32))

    return Rope(inv_freq(scaling["short_factor"]), float(attention_factor), inv_freq(scaling["long_factor"]))


def _llama3(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
    return np.where(medium, smoothed, scaled)


def _yarn(base: float, dim: int, scaling: dict, max_position_embeddings) -> tuple[np.ndarray, float]:
    factor = scaling["factor"]
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / ((high - low) or 0.001), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor
