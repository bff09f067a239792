"""The `tpu` backend: levanter's ragged paged attention over levanter's paged cache layout.

On a TPU (v4 and later) `levanter.layers.attention.ragged_paged_attention` runs the Pallas ragged
paged attention kernel under `shard_map` (each device its own KV heads); elsewhere it runs
levanter's reference implementation (loops over sequences, query tokens and page blocks: slow, but
exact), which is how CI tests this backend on CPUs.

The packed token layout (engine.core.buckets) is the kernel's own: rows one after another,
`cu_q_lens` their boundaries, `kv_lens` each row's tokens in the cache after the step,
`page_indices` every row's page table over `max_model_len` (the kernel reads only the pages
`kv_lens` covers); only the step's end is padded to its token bucket.

The cache is one array for all layers, [layer * page, slot, 2 * kv_head, head_dim] (levanter's
`KvPageCache` layout with the layers' pages one after another), the key of head h at 2h and its
value at 2h + 1. Layer l's page p is page l * num_pages + p of it, so the kernel reads any layer's
pages as they are stored, from the whole array: a layer index that is traced (the scanned layer
loop) costs no copy (a slice of a stacked array would be copied for the custom call, every layer
of every step). Under tensor parallelism the combined head axis is split on the model axis:
device d holds heads [d * H / n, (d + 1) * H / n), keys and values interleaved, as the kernel
expects.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from levanter.layers.attention import ragged_paged_attention

from engine.backends.base import KV_AXES, Q_AXES, AttentionBackend, AttentionStep, CacheShape


class RaggedKVCache(eqx.Module):
    """f[layer * page, slot, 2 * kv_head, head_dim]: every layer's pages, keys at even, values at odd heads."""

    pages: jax.Array
    num_layers: int = eqx.field(static=True)


class TpuBackend(AttentionBackend):
    name = "tpu"

    def init_cache(self, shape: CacheShape) -> RaggedKVCache:
        s = shape
        pages = jnp.zeros((s.num_layers * s.num_pages, s.page_size, 2 * s.kv_heads, s.head_dim), s.dtype)
        return RaggedKVCache(pages, s.num_layers)

    def cache_partition(self, model_axis: str) -> PartitionSpec:
        return PartitionSpec(None, None, model_axis, None)

    def attend(self, cache: RaggedKVCache, layer, q, k, v, scale, step: AttentionStep):
        inputs = step.inputs
        pages = cache.pages
        page_size = pages.shape[1]
        first = layer * (pages.shape[0] // cache.num_layers)  # layer's page 0
        kv = jnp.stack([k.rearrange(KV_AXES).array, v.rearrange(KV_AXES).array], axis=2)  # [T, kv_head, 2, d]
        kv = kv.reshape(kv.shape[0], -1, kv.shape[-1]).astype(pages.dtype)  # key h at 2h, value at 2h + 1
        pages = pages.at[first + inputs.kv_dest // page_size, inputs.kv_dest % page_size].set(kv)
        cu_q_lens = jnp.concatenate([inputs.q_start, inputs.q_start[-1:] + inputs.q_lens[-1:]])
        o = ragged_paged_attention(
            q.rearrange(Q_AXES),
            hax.named(pages, ("page", "slot", "kv_head", "head_size")),
            hax.named(inputs.kv_lens, "seq"),
            hax.named(first + inputs.page_table, ("seq", "page")),
            hax.named(cu_q_lens, "seq_boundary"),
            jnp.sum(inputs.q_lens > 0, dtype=jnp.int32),
            sm_scale=scale,
        )
        return o.rearrange(Q_AXES), RaggedKVCache(pages, cache.num_layers)
