"""The `xla` backend: masked attention in plain JAX, the portable path (any device, any mesh).

Each token is a query against its own sequence (its row's page table), causal by position, in the
packed token layout every backend reads (engine.step.buckets). Keys and values are read in blocks
of `BLOCK_TOKENS` cached tokens with a running softmax (flash attention's recurrence), in a loop
whose trip count is the step's longest visible length: a step costs what its rows' lengths need,
and the page table's width (max_model_len) is no dimension of the program.

The cache (`SplitKVCache`) keeps keys f[layer, page, kv_head, head_dim, slot] and values
f[layer, page, kv_head, slot, head_dim]: a page is one contiguous block per head, so gathering a
block of pages copies whole blocks, and keys keep the token position minor, as the score
reduction wants it. A cache whose values are its keys (`CacheShape.values_are_keys`: latent
attention) keeps the values alone and reads the keys from them. Both are split on `kv_head` under
tensor parallelism: every device attends with its own heads, and only the output projection's
all-reduce crosses devices.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray
from jax.sharding import PartitionSpec

from engine.backends.base import (
    Q_AXES,
    AttentionBackend,
    AttentionStep,
    CacheShape,
    LayerAttention,
    visible_tokens,
)

NEG_INF = -1e30


class SplitKVCache(eqx.Module):
    """Keys f[layer, page, kv_head, head_dim, slot] (None: the values are the keys) and values
    f[layer, page, kv_head, slot, head_dim]."""

    k: jax.Array | None
    v: jax.Array

    @classmethod
    def zeros(cls, shape: CacheShape, dtype) -> "SplitKVCache":
        s = shape
        k = None if s.values_are_keys else jnp.zeros((s.num_layers, s.num_pages, s.kv_heads, s.head_dim, s.page_size),
                                                     dtype)
        v = jnp.zeros((s.num_layers, s.num_pages, s.kv_heads, s.page_size, s.head_dim), dtype)
        return cls(k, v)

    def write(self, layer, kv_dest: jax.Array, k: NamedArray, v: NamedArray) -> "SplitKVCache":
        """Store each token's key and value at its flat slot `kv_dest` (page * page_size + slot);
        where the values are the keys, `v` alone (it is `k`)."""
        page, slot = kv_dest // self.page_size, kv_dest % self.page_size
        v_arr = self.stored(v.rearrange(("position", "kv_head", "head_size")).array)
        keys = self.k
        if keys is not None:
            k_arr = self.stored(k.rearrange(("position", "kv_head", "head_size")).array)
            keys = keys.at[layer, page, :, :, slot].set(k_arr)
        return dataclasses.replace(self, k=keys, v=self.v.at[layer, page, :, slot].set(v_arr))

    @property
    def page_size(self) -> int:
        return self.v.shape[-2]

    def stored(self, x: jax.Array) -> jax.Array:
        """x as the cache stores it."""
        return x.astype(self.v.dtype)


class XlaBackend(AttentionBackend):
    name = "xla"

    def __init__(self, platform: str):
        """Attention on devices of `platform` (engine.backends.base.platform_of the mesh)."""
        self.platform = platform
        self.scan_layers = platform != "cpu"
        """Scanned on accelerators (compile time independent of depth); unrolled on a CPU, where XLA
        copies each layer's weights out of the stack every step, which costs more than the loop saves."""

    def init_cache(self, shape: CacheShape) -> SplitKVCache:
        return SplitKVCache.zeros(shape, self.storage_dtype(shape.dtype))

    def cache_partition(self, model_axis: str) -> PartitionSpec:
        return PartitionSpec(None, None, model_axis, None, None)  # keys and values: [layer, page, kv_head, ...]

    def begin_step(self, inputs) -> AttentionStep:
        """Each token's page table (its row's) and visible length, once for all layers."""
        return AttentionStep(inputs, (inputs.page_table[inputs.token_row], visible_tokens(inputs)))

    def attend(self, cache: SplitKVCache, layer, q, k, v, how: LayerAttention, step: AttentionStep):
        cache = cache.write(layer, step.inputs.kv_dest, k, v)
        q_arr = q.rearrange(Q_AXES).array.astype(jnp.float32) * how.scale
        tables, lens = step.tables
        first = jnp.where(how.slides, lens - how.window, 0) if how.window is not None else None
        o = _paged_attention(q_arr, cache, layer, tables, lens, first, how.softcap, how.sink_logits())
        return hax.named(o, Q_AXES), cache


BLOCK_TOKENS = 128
"""Cached tokens one iteration of the attention loop reads per query (whole pages)."""


def _paged_attention(q, cache: SplitKVCache, layer, tables, lens, first=None, softcap=None, sinks=None):
    """q: f32[T, kv_head, group, head_dim] (pre-scaled); tables: i32[T, L] each query's page table;
    lens: i32[T] tokens each query sees (0: padding, whose output is garbage the caller never reads);
    first: i32[T] the first of them it sees (a sliding window; None: 0); softcap: scores become
    cap * tanh(scores / cap); sinks: f32[kv_head, group] each query head's sink logit (None: no
    sinks). Returns f32[T, kv_head, group, head_dim]."""
    tokens, heads, _, dim = q.shape

    def read(pages):
        v = cache.v[layer, pages].transpose(0, 2, 1, 3, 4).reshape(tokens, heads, -1, dim)
        if cache.k is None:  # the values are the keys
            return v.transpose(0, 1, 3, 2), v
        return cache.k[layer, pages].transpose(0, 2, 3, 1, 4).reshape(tokens, heads, dim, -1), v

    return flash_paged_attention(q, read, cache.page_size, tables, lens, first, softcap, sinks)


def flash_paged_attention(q, read, page_size: int, tables, lens, first=None, softcap=None, sinks=None):
    """`_paged_attention` over any page layout: `read(pages)` gives the keys f[T, kv_head, head_dim, K]
    and values f[T, kv_head, K, head_dim] of the K = B * page_size tokens of pages i32[T, B] (B pages
    of each query's table). A sink enters the recurrence as its initial running maximum, with running
    sum exp(sink - sink) = 1 and no value (flash attention's sinks)."""
    tokens, heads, group, dim = q.shape
    block = max(1, BLOCK_TOKENS // page_size)  # pages per iteration
    width = -(-tables.shape[1] // block) * block
    tables = jnp.pad(tables, ((0, 0), (0, width - tables.shape[1])))  # padding reads the scratch page, masked
    num_blocks = (jnp.max(lens) + block * page_size - 1) // (block * page_size)

    def attend_block(i, carry):
        top, total, acc = carry  # running max f32[T, h, g], softmax denominator f32[T, h, g], f32[T, h, g, d]
        k, v = read(jax.lax.dynamic_slice_in_dim(tables, i * block, block, axis=1))
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        scores = (q[..., None] * k[:, :, None]).sum(axis=3)  # [T, h, g, K]
        if softcap is not None:
            scores = jnp.tanh(scores / softcap) * softcap
        position = i * block * page_size + jnp.arange(k.shape[-1])
        seen = position[None, :] < lens[:, None]
        if first is not None:
            seen = seen & (position[None, :] >= first[:, None])
        scores = jnp.where(seen[:, None, None, :], scores, NEG_INF)
        new_top = jnp.maximum(top, scores.max(axis=-1))
        weights = jnp.exp(scores - new_top[..., None])
        if first is not None:  # a block wholly before a query's window must add nothing
            weights = jnp.where(seen[:, None, None, :], weights, 0.0)
        rescale = jnp.exp(top - new_top)
        acc = acc * rescale[..., None] + (weights[..., None] * v[:, :, None]).sum(axis=3)
        return new_top, total * rescale + weights.sum(axis=-1), acc

    shape = (tokens, heads, group)
    if sinks is None:
        top, total = jnp.full(shape, NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32)
    else:
        top, total = jnp.broadcast_to(sinks.astype(jnp.float32), shape), jnp.ones(shape, jnp.float32)
    init = (top, total, jnp.zeros((*shape, dim), jnp.float32))
    _, total, acc = jax.lax.fori_loop(0, num_blocks, attend_block, init)
    return acc / jnp.maximum(total, 1e-30)[..., None]
