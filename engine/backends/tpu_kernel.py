"""JAX's Pallas ragged paged attention kernel, called for a TPU generation named by the caller.

The kernel (jax.experimental.pallas.ops.tpu.ragged_paged_attention) picks its block sizes from a
table keyed by the TPU generation, which it reads from the local default device: on a host that
compiles for a TPU it does not have (engine.tools.aot) that device is a CPU and the kernel
refuses. Here the generation comes from the mesh the step runs on (`device_kind`), and the block
sizes from the same table, so a replica on a TPU and an ahead-of-time compile on a CPU host build
the same program.

Layout (the tpu backend's, engine.backends.tpu): q [token, q_head, head_dim] with query head
h * G + g served by KV head h; pages [page, slot, 2 * kv_head, head_dim], keys at even, values at
odd positions, or, for a cache whose values are its keys (latent attention), [page, slot, kv_head,
head_dim], keys only. Under tensor parallelism both split by head on the model axis and each device
runs the kernel over its own heads (shard_map): no collective. The kernel wants head_dim a multiple of
128 lanes: the pages store smaller heads zero-padded (`lane_padded`; padding them per step would
copy the whole cache every layer), the queries are padded per step (zeros change no score) and
the output is cut back.

Layers with attention sinks (a learned logit per query head in the softmax's denominator), and
caches whose values are their keys (one KV head a device), run a modified copy of the kernel
(engine.backends.tpu_kernel_modified: its running max starts at the sink; it reads each block's keys
as its values), with the same block sizes; the others run JAX's kernel itself.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
    tuned_block_sizes as tuned,
)
from jax.sharding import Mesh, PartitionSpec

from engine.backends.tpu_kernel_modified import ragged_paged_attention_modified

LANES = 128


def lane_padded(head_dim: int) -> int:
    """The head size the kernel reads: `head_dim` rounded up to a multiple of 128 lanes."""
    return -(-head_dim // LANES) * LANES


def tpu_generation(device_kind: str) -> int:
    """4 for "TPU v4", 5 for "TPU v5 lite" (v5e) and "TPU v5" (v5p), 6 for "TPU v6 lite"; ValueError otherwise."""
    kind = device_kind.removesuffix(" lite")
    if kind == "TPU7x":
        return 7
    if not kind.startswith("TPU v") or not kind[5:6].isdigit():
        raise ValueError(f"{device_kind!r} is not a TPU the ragged paged attention kernel knows")
    return int(kind[5])


def block_sizes(device_kind: str, q_dtype, kv_dtype, num_q_heads: int, num_combined_kv_heads: int, head_dim: int,
                page_size: int, num_tokens: int, pages_per_seq: int, values_are_keys: bool = False) -> tuple[int, int]:
    """(KV pages, queries) per kernel block for `device_kind`: the kernel's own tuned table (its
    `get_tuned_block_sizes`, with the generation given rather than read from the local device).
    `num_combined_kv_heads`: the heads the pages hold, a key and a value per KV head, or the keys
    alone where `values_are_keys` (the table is keyed by KV heads per block either way)."""
    generation = tpu_generation(device_kind)
    if generation < 4:
        raise ValueError(f"the ragged paged attention kernel needs TPU v4 or later, not {device_kind!r}")
    arrays = 1 if values_are_keys else 2
    kv_heads = num_combined_kv_heads // arrays
    q_heads_per_block, combined_per_block = rpa.get_min_heads_per_blk(num_q_heads, 2 * kv_heads, q_dtype, kv_dtype)
    kv_heads_per_block = combined_per_block // 2
    key = tuned.simplify_key((q_dtype, kv_dtype, q_heads_per_block, kv_heads_per_block, head_dim, page_size,
                              num_tokens, pages_per_seq))
    pages, queries = (32, 32) if generation == 4 else (128, 32)  # the kernel's defaults
    table = tuned.TUNED_BLOCK_SIZES.get(" ".join(device_kind.split()[:2]), {})
    if generation > 4 and key in table:
        pages, queries = table[key]
    pages, queries = min(pages_per_seq, pages), min(num_tokens, queries)
    while pages > 1 and _vmem_bytes(pages, queries, page_size, kv_heads_per_block * arrays, q_heads_per_block,
                                    head_dim, num_q_heads // kv_heads, q_dtype, kv_dtype, arrays) > VMEM_BUDGET:
        pages //= 2  # the defaults overflow the scoped VMEM with many KV heads per block (v5p, 8 heads)
    return pages, queries


VMEM_BUDGET = 12 * 2**20
"""Of the 16 MiB of VMEM a TPU kernel may use by default (Mosaic's scoped limit), what the block
sizes may take: the rest is left to Mosaic's own temporaries."""


def _vmem_bytes(pages: int, queries: int, page_size: int, combined_heads: int, q_heads: int, head_dim: int,
                group: int, q_dtype, kv_dtype, arrays: int = 2) -> int:
    """The kernel's VMEM for these blocks (`combined_heads` KV heads times `arrays`: 2, keys and
    values interleaved, or 1, keys that are the values): the double-buffered KV block, the float32
    accumulator, the softmax's running max and sum (128 lanes each), the query and output blocks
    (double-buffered), and Mosaic's temporaries, which outgrow the rest with wide heads (DeepSeek's
    576-wide latent): a KV head's float32 scores over the block with their exponentials, and its
    keys and values (`arrays` of them) read out of the block once more (compiled with libtpu:
    DeepSeek-V3's 128 pages of one interleaved 640-lane head overflow the 16 MiB without them counted)."""
    kv_item, q_item = jnp.dtype(kv_dtype).itemsize, jnp.dtype(q_dtype).itemsize
    kv = 2 * pages * page_size * combined_heads * head_dim * kv_item
    acc = queries * q_heads * head_dim * 4
    softmax = 2 * (combined_heads // arrays) * queries * group * 128 * 4
    q_and_out = 2 * 2 * queries * q_heads * head_dim * q_item
    scores = 2 * queries * group * pages * page_size * 4
    head = arrays * pages * page_size * head_dim * kv_item
    return kv + acc + softmax + q_and_out + scores + head


def ragged_paged_attention(q: jax.Array, pages: jax.Array, kv_lens: jax.Array, page_indices: jax.Array,
                           cu_q_lens: jax.Array, num_seqs: jax.Array, *, scale: float, mesh: Mesh,
                           model_axis: str, device_kind: str, interpret: bool = False,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           sinks: jax.Array | None = None, values_are_keys: bool = False) -> jax.Array:
    """The kernel over every device's own heads: q [T, H, D], pages [P, S, 2K, lane_padded(D)]
    (both split by head on `model_axis`), kv_lens i32[N], page_indices i32[N, pages_per_seq], cu_q_lens i32[N + 1],
    num_seqs i32[1]; returns [T, H, D]. `interpret`: run it in Pallas' TPU interpret mode (any device).
    `sliding_window`, `soft_cap`: the kernel's own (static). `sinks`: f32[H] each query head's sink
    logit (split by head as q), or None. `values_are_keys`: pages [P, S, K, lane_padded(D)] hold keys
    only, each its value too (one KV head a device: K = the model axis' size)."""
    head_dim, padded = q.shape[-1], pages.shape[-1]
    if padded != lane_padded(head_dim):
        raise ValueError(f"the KV pages' head_dim {padded} must be the queries' {head_dim} padded to {LANES} lanes")
    q = jnp.pad(q, ((0, 0), (0, 0), (0, padded - head_dim)))
    shards = mesh.shape[model_axis]
    kv_blocks, q_blocks = block_sizes(device_kind, q.dtype, pages.dtype, q.shape[1] // shards,
                                      pages.shape[2] // shards, padded, pages.shape[1], q.shape[0],
                                      page_indices.shape[1], values_are_keys)
    blocks = dict(sm_scale=scale, num_kv_pages_per_block=kv_blocks, num_queries_per_block=q_blocks,
                  sliding_window=sliding_window, soft_cap=soft_cap)
    if sinks is None and not values_are_keys:
        kernel = functools.partial(rpa.ragged_paged_attention, **blocks)
    else:
        kernel = functools.partial(ragged_paged_attention_modified, values_are_keys=values_are_keys, **blocks)
    heads = PartitionSpec(None, model_axis, None)
    in_specs = (heads, PartitionSpec(None, None, model_axis, None), PartitionSpec(), PartitionSpec(), PartitionSpec(),
                PartitionSpec())
    args = (q, pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if sinks is not None:
        in_specs, args = in_specs + (PartitionSpec(model_axis),), args + (sinks.astype(jnp.float32),)
    per_device = jax.shard_map(kernel, mesh=mesh, in_specs=in_specs, out_specs=heads, check_vma=False)
    with pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext():
        out = per_device(*args)
    return out[..., :head_dim]
