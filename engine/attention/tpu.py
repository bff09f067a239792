"""The `tpu` backend: levanter's ragged paged attention over levanter's paged cache layout.

On a TPU (v4 and later) `levanter.layers.attention.ragged_paged_attention` runs the Pallas ragged
paged attention kernel under `shard_map` (each device its own KV heads); elsewhere it runs
levanter's reference implementation (loops over sequences, query tokens and page blocks: slow, but
exact), which is how CI tests this backend on CPUs.

The packed token layout (engine.core.buckets) is the kernel's own: rows one after another,
`cu_q_lens` their boundaries, `kv_lens` each row's tokens in the cache after the step,
`page_indices` every row's page table over `max_model_len` (the kernel reads only the pages
`kv_lens` covers); only the step's end is padded to its token bucket.

The cache is one array per layer, [page, slot, 2 * kv_head, head_dim] with the key of head h at
2h and its value at 2h + 1 (levanter's `KvPageCache` layout), so the kernel reads a layer's pages
as they are stored (a slice of one stacked array would be copied for the custom call, every layer
of every step). Per-layer buffers need a static layer index: this backend runs the unrolled layer
loop only. Under tensor parallelism the combined head axis is split on the model axis: device d
holds heads [d * H / n, (d + 1) * H / n), keys and values interleaved, as the kernel expects.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from levanter.layers.attention import ragged_paged_attention

from engine.attention.base import KV_AXES, Q_AXES, AttentionBackend, AttentionStep, CacheShape


class RaggedKVCache(eqx.Module):
    """One array per layer: f[page, slot, 2 * kv_head, head_dim], keys at even, values at odd heads."""

    pages: tuple


class TpuBackend(AttentionBackend):
    name = "tpu"
    scannable = False

    def init_cache(self, shape: CacheShape) -> RaggedKVCache:
        s = shape
        layer = (s.num_pages, s.page_size, 2 * s.kv_heads, s.head_dim)
        return RaggedKVCache(tuple(jnp.zeros(layer, s.dtype) for _ in range(s.num_layers)))

    def cache_partition(self, model_axis: str) -> PartitionSpec:
        return PartitionSpec(None, None, model_axis, None)

    def attend(self, cache: RaggedKVCache, layer, q, k, v, scale, step: AttentionStep):
        if not isinstance(layer, int):
            raise ValueError("the tpu attention backend needs the unrolled layer loop; set scan_layers: false")
        inputs = step.inputs
        pages = cache.pages[layer]
        page_size = pages.shape[1]
        kv = jnp.stack([k.rearrange(KV_AXES).array, v.rearrange(KV_AXES).array], axis=2)  # [T, kv_head, 2, d]
        kv = kv.reshape(kv.shape[0], -1, kv.shape[-1]).astype(pages.dtype)  # key h at 2h, value at 2h + 1
        pages = pages.at[inputs.kv_dest // page_size, inputs.kv_dest % page_size].set(kv)
        cu_q_lens = jnp.concatenate([inputs.q_start, inputs.q_start[-1:] + inputs.q_lens[-1:]])
        o = ragged_paged_attention(
            q.rearrange(Q_AXES),
            hax.named(pages, ("page", "slot", "kv_head", "head_size")),
            hax.named(inputs.kv_lens, "seq"),
            hax.named(inputs.page_table, ("seq", "page")),
            hax.named(cu_q_lens, "seq_boundary"),
            jnp.sum(inputs.q_lens > 0, dtype=jnp.int32),
            sm_scale=scale,
        )
        new_pages = cache.pages[:layer] + (pages,) + cache.pages[layer + 1:]
        return o.rearrange(Q_AXES), RaggedKVCache(new_pages)
