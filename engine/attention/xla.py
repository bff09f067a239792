"""The `xla` backend: dense masked attention in plain JAX, the portable path (any device, any mesh).

Padded token layout (engine.core.buckets): the decode group (`Sd` rows of one token) and the
prefill group (`Sp` rows of `C` token slots). Each row gathers its `L` pages and attends densely:

- decode group: one query per row against its pages, a broadcast multiply-and-reduce (XLA on CPU
  runs many tiny (group x head_dim x K) einsums several times slower than a vectorised reduction);
- prefill group: the row's chunk against its pages, causal within the row, two einsums.

The cache (`SplitKVCache`) keeps keys f[layer, page, kv_head, head_dim, slot] and values
f[layer, page, kv_head, slot, head_dim]: a page is one contiguous block per head, so gathering a
row's pages copies whole blocks, and keys keep the token position minor, as the decode reduction
wants it. Both are split on `kv_head` under tensor parallelism: every device attends with its own
heads, and only the output projection's all-reduce crosses devices.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray
from jax.sharding import PartitionSpec

from engine.attention.base import Q_AXES, AttentionBackend, AttentionStep, CacheShape

NEG_INF = -1e30


class SplitKVCache(eqx.Module):
    """Keys f[layer, page, kv_head, head_dim, slot] and values f[layer, page, kv_head, slot, head_dim]."""

    k: jax.Array
    v: jax.Array

    @staticmethod
    def zeros(shape: CacheShape, dtype) -> "SplitKVCache":
        s = shape
        k = jnp.zeros((s.num_layers, s.num_pages, s.kv_heads, s.head_dim, s.page_size), dtype)
        v = jnp.zeros((s.num_layers, s.num_pages, s.kv_heads, s.page_size, s.head_dim), dtype)
        return SplitKVCache(k, v)

    def write(self, layer, kv_dest: jax.Array, k: NamedArray, v: NamedArray) -> "SplitKVCache":
        """Store each token's key and value at its flat slot `kv_dest` (page * page_size + slot)."""
        page_size = self.k.shape[-1]
        page, slot = kv_dest // page_size, kv_dest % page_size
        k_arr = _stored(k.rearrange(("position", "kv_head", "head_size")).array, self.k.dtype)
        v_arr = _stored(v.rearrange(("position", "kv_head", "head_size")).array, self.v.dtype)
        return SplitKVCache(self.k.at[layer, page, :, :, slot].set(k_arr), self.v.at[layer, page, :, slot].set(v_arr))


def _stored(x: jax.Array, dtype) -> jax.Array:
    """x in the cache's storage dtype; a uint16 cache holds bfloat16 bits (the cpu backend's)."""
    if dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(dtype)


class XlaBackend(AttentionBackend):
    name = "xla"

    def init_cache(self, shape: CacheShape) -> SplitKVCache:
        return SplitKVCache.zeros(shape, self.storage_dtype(shape.dtype))

    def cache_partition(self, model_axis: str) -> PartitionSpec:
        return PartitionSpec(None, None, model_axis, None, None)  # keys and values: [layer, page, kv_head, ...]

    def attend(self, cache: SplitKVCache, layer, q, k, v, scale, step: AttentionStep):
        cache = cache.write(layer, step.inputs.kv_dest, k, v)
        q_arr = q.rearrange(Q_AXES).array.astype(jnp.float32) * scale
        inputs, sd = step.inputs, step.bucket.decode_rows
        out = []
        if sd:
            out.append(_decode_attention(q_arr[:sd], cache, layer, inputs.page_table[:sd], inputs.kv_lens[:sd]))
        if step.bucket.prefill_rows:
            start = inputs.kv_lens[sd:] - inputs.q_lens[sd:]  # position of each prefill row's first token
            out.append(_prefill_attention(q_arr[sd:], cache, layer, inputs.page_table[sd:], start))
        o = jnp.concatenate(out, axis=0) if len(out) > 1 else out[0]
        return hax.named(o, Q_AXES), cache


def _gather_pages(cache: SplitKVCache, layer, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's keys f32[row, kv_head, head_dim, K] and values f32[row, kv_head, K, head_dim],
    K = pages per row * page_size: the key position is the minor axis of both reductions below."""
    rows = pages.shape[0]
    k = cache.k[layer, pages].transpose(0, 2, 3, 1, 4)  # [row, head, dim, L, slot]
    v = cache.v[layer, pages].transpose(0, 2, 1, 3, 4)  # [row, head, L, slot, dim]
    k = k.reshape(rows, k.shape[1], k.shape[2], -1).astype(jnp.float32)
    v = v.reshape(rows, v.shape[1], -1, v.shape[-1]).astype(jnp.float32)
    return k, v


def _decode_attention(q, cache, layer, pages, lens):
    """q: f32[Sd, kv_head, group, head_dim] (pre-scaled), one query per row at position lens - 1."""
    k, v = _gather_pages(cache, layer, pages)
    scores = (q[..., None] * k[:, :, None]).sum(axis=3)  # [Sd, h, g, K]
    visible = jnp.arange(k.shape[-1])[None, :] < lens[:, None]  # [Sd, K]
    weights = _masked_softmax(scores, visible[:, None, None, :])
    return (weights[..., None] * v[:, :, None]).sum(axis=3)  # [Sd, h, g, d]


def _prefill_attention(q, cache, layer, pages, start):
    """q: f32[Sp * C, kv_head, group, head_dim] (pre-scaled); row r's token j is at start[r] + j."""
    rows = pages.shape[0]
    q = q.reshape(rows, -1, *q.shape[1:])  # [Sp, C, h, g, d]
    k, v = _gather_pages(cache, layer, pages)
    scores = jnp.einsum("schgd,shdk->shgck", q, k)
    q_pos = start[:, None] + jnp.arange(q.shape[1])[None, :]  # [Sp, C]
    visible = jnp.arange(k.shape[-1])[None, None, :] <= q_pos[:, :, None]  # causal, within the row
    weights = _masked_softmax(scores, visible[:, None, None, :, :])
    out = jnp.einsum("shgck,shkd->schgd", weights, v)
    return out.reshape(-1, *out.shape[2:])


def _masked_softmax(scores, visible):
    """Softmax over the last axis where visible. Rows with nothing visible (padding) get finite
    garbage that the caller never reads."""
    return jax.nn.softmax(jnp.where(visible, scores, NEG_INF), axis=-1)
