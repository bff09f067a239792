"""The `tpu` backend: ragged paged attention over levanter's paged cache layout.

On a mesh of TPUs (v4 and later) it runs JAX's Pallas ragged paged attention kernel under
`shard_map`, each device over its own KV heads, for the generation of the mesh's devices
(engine.backends.tpu_kernel): a replica on a TPU and an ahead-of-time compile for a TPU topology on
a CPU host (engine.tools.aot) build the same program. A kernel that cannot compile fails the
compile; it never falls back silently. On other devices it runs levanter's reference implementation
(loops over sequences, query tokens and page blocks: slow, but exact), which is how CI tests this
backend's numbers on CPUs; layers that slide or have attention sinks, which levanter's reference
lacks, run the xla backend's blockwise softmax over this cache's pages instead
(engine.backends.xla.flash_paged_attention). The kernel itself runs on CPUs in Pallas' TPU interpret
mode (`interpret_as`, for tests).

The packed token layout (engine.step.buckets) is the kernel's own: rows one after another,
`cu_q_lens` their boundaries, `kv_lens` each row's tokens in the cache after the step,
`page_indices` every row's page table over `max_model_len` (the kernel reads only the pages
`kv_lens` covers); only the step's end is padded to its token bucket.

The cache is one array for all layers, [layer * page, slot, 2 * kv_head, head_dim] (levanter's
`KvPageCache` layout with the layers' pages one after another), the key of head h at 2h and its
value at 2h + 1; where each token's value is its key (`CacheShape.values_are_keys`: latent
attention's latent), [layer * page, slot, kv_head, head_dim], the keys alone, which attention reads
as the values too (the reference's recurrence and the modified kernel; levanter's reference needs
interleaved keys and values). Layer l's page p is page l * num_pages + p of it, so the kernel reads
any layer's pages as they are stored, from the whole array: a layer index that is traced (the
scanned layer loop) costs no copy (a slice of a stacked array would be copied for the custom call, every layer
of every step). For the kernel, heads smaller than 128 lanes are stored zero-padded to 128
(engine.backends.tpu_kernel). Under tensor parallelism the combined head axis is split on the model axis:
device d holds heads [d * H / n, (d + 1) * H / n), keys and values interleaved (or keys alone), as
the kernel expects.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from levanter.layers.attention import default_ragged_paged_attention

from engine.backends import tpu_kernel
from engine.backends.base import (
    KV_AXES,
    Q_AXES,
    AttentionBackend,
    AttentionStep,
    CacheShape,
    LayerAttention,
    platform_of,
    visible_tokens,
)
from engine.backends.xla import flash_paged_attention


class RaggedKVCache(eqx.Module):
    """f[layer * page, slot, 2 * kv_head, head_dim]: every layer's pages, keys at even, values at odd heads;
    f[layer * page, slot, kv_head, head_dim], the keys alone, where `values_are_keys`."""

    pages: jax.Array
    num_layers: int = eqx.field(static=True)
    values_are_keys: bool = eqx.field(static=True, default=False)
    """Each token's value is its key: the pages hold the keys only."""


class TpuBackend(AttentionBackend):
    name = "tpu"

    def __init__(self, mesh: Mesh, model_axis: str, interpret_as: Optional[str] = None):
        """Attention over `mesh` (KV heads split on `model_axis`): the Pallas kernel where its
        devices are TPUs, else the reference implementation. `interpret_as` (a TPU device kind,
        e.g. "TPU v5 lite"): the kernel as built for that generation, run on any device in Pallas'
        TPU interpret mode (slow: for tests of the kernel's numbers on CPUs)."""
        self.mesh, self.model_axis, self.interpret = mesh, model_axis, interpret_as is not None
        self.platform = platform_of(mesh)
        kind = mesh.devices.flat[0].device_kind if self.platform == "tpu" else None
        self.kernel_target: Optional[str] = interpret_as or kind
        """The TPU generation the kernel is built for (a device kind); None: the reference implementation."""

    def init_cache(self, shape: CacheShape) -> RaggedKVCache:
        s = shape
        pages = jnp.zeros((s.num_layers * s.num_pages, s.page_size, s.arrays * s.kv_heads,
                           self._stored_head_dim(s.head_dim)), s.dtype)
        return RaggedKVCache(pages, s.num_layers, s.values_are_keys)

    def cache_bytes_per_page(self, shape: CacheShape) -> int:
        """The base's count (keys and values, or keys alone) over the heads as stored (lane-padded for the kernel)."""
        padded = dataclasses.replace(shape, head_dim=self._stored_head_dim(shape.head_dim))
        return super().cache_bytes_per_page(padded)

    def _stored_head_dim(self, head_dim: int) -> int:
        """The kernel reads heads padded to 128 lanes (a head_dim 64 model's cache is twice the size)."""
        return head_dim if self.kernel_target is None else tpu_kernel.lane_padded(head_dim)

    def cache_partition(self, model_axis: str) -> PartitionSpec:
        return PartitionSpec(None, None, model_axis, None)

    def attend(self, cache: RaggedKVCache, layer, q, k, v, how: LayerAttention, step: AttentionStep):
        inputs = step.inputs
        pages = cache.pages
        page_size = pages.shape[1]
        first = layer * (pages.shape[0] // cache.num_layers)  # layer's page 0
        kv = _stored(k, None if cache.values_are_keys else v).astype(pages.dtype)
        kv = jnp.pad(kv, ((0, 0), (0, 0), (0, pages.shape[-1] - kv.shape[-1])))  # the kernel's lanes (if padded)
        pages = pages.at[first + inputs.kv_dest // page_size, inputs.kv_dest % page_size].set(kv)
        attend = self._reference if self.kernel_target is None else self._kernel
        o = attend(q.rearrange(Q_AXES), pages, first + inputs.page_table, how, inputs, cache.values_are_keys)
        return o.rearrange(Q_AXES), RaggedKVCache(pages, cache.num_layers, cache.values_are_keys)

    @staticmethod
    def _reference(q, pages, page_table, how: LayerAttention, inputs, values_are_keys: bool):
        """Levanter's reference; with a sliding window or sinks, or keys that are the values, the xla
        backend's recurrence over these pages (each token a query over its row's table, as the xla
        backend attends)."""
        if how.window is None and how.sinks is None and not values_are_keys:
            cu_q_lens = jnp.concatenate([inputs.q_start, inputs.q_start[-1:] + inputs.q_lens[-1:]])
            num_seqs = jnp.sum(inputs.q_lens > 0, dtype=jnp.int32)  # rows are packed: padding rows come last
            return default_ragged_paged_attention(
                q, hax.named(pages, ("page", "slot", "kv_head", "head_size")), hax.named(inputs.kv_lens, "seq"),
                hax.named(page_table, ("seq", "page")), cu_q_lens, num_seqs, sm_scale=how.scale, soft_cap=how.softcap)
        lens = visible_tokens(inputs)
        first = jnp.where(how.slides, lens - how.window, 0) if how.window is not None else None

        def read(blocks):  # [T, B] pages -> keys [T, kv_head, d, B * S], values [T, kv_head, B * S, d]
            kv = pages[blocks]  # [T, B, S, 2 * kv_head, d], or [T, B, S, kv_head, d] where values are keys
            k = (kv if values_are_keys else kv[..., 0::2, :]).transpose(0, 3, 4, 1, 2)
            v = (kv if values_are_keys else kv[..., 1::2, :]).transpose(0, 3, 1, 2, 4)
            return k.reshape(*k.shape[:3], -1), v.reshape(*v.shape[:2], -1, v.shape[-1])

        q_arr = q.array.astype(jnp.float32) * how.scale
        o = flash_paged_attention(q_arr, read, pages.shape[1], page_table[inputs.token_row], lens, first, how.softcap,
                                  how.sink_logits())
        return hax.named(o.astype(q.dtype), Q_AXES)

    def _kernel(self, q, pages, page_table, how: LayerAttention, inputs, values_are_keys: bool):
        """The Pallas kernel over each device's heads; a scanned loop's sliding layers chosen per layer."""
        cu_q_lens = jnp.concatenate([inputs.q_start, inputs.q_start[-1:] + inputs.q_lens[-1:]])
        num_seqs = jnp.sum(inputs.q_lens > 0, dtype=jnp.int32)  # rows are packed: padding rows come last
        flat = q.flatten_axes(("kv_head", "q_heads_per_group"), "q_head")  # query head h * G + g: KV head h
        sinks = how.sink_logits()
        kernel = functools.partial(
            tpu_kernel.ragged_paged_attention, flat.rearrange(("position", "q_head", "head_size")).array, pages,
            inputs.kv_lens, page_table, cu_q_lens, num_seqs.reshape(1), scale=how.scale, mesh=self.mesh,
            model_axis=self.model_axis, device_kind=self.kernel_target, interpret=self.interpret, soft_cap=how.softcap,
            sinks=None if sinks is None else sinks.reshape(-1), values_are_keys=values_are_keys)
        if how.window is None:
            out = kernel()
        elif isinstance(how.slides, bool):
            out = kernel(sliding_window=how.window if how.slides else None)
        else:  # a scanned loop: the layer's kind is traced, the kernel's window static
            out = jax.lax.cond(how.slides, lambda: kernel(sliding_window=how.window), kernel)
        return hax.named(out, ("position", "q_head", "head_size")).unflatten_axis(
            "q_head", (q.resolve_axis("kv_head"), q.resolve_axis("q_heads_per_group")))


def _stored(k, v) -> jax.Array:
    """[T, 2 * kv_head, d]: the step's keys and values as the cache holds them, key h at 2h and value at
    2h + 1; v None (values that are the keys): [T, kv_head, d], the keys alone."""
    if v is None:
        return k.rearrange(KV_AXES).array
    kv = jnp.stack([k.rearrange(KV_AXES).array, v.rearrange(KV_AXES).array], axis=2)  # [T, kv_head, 2, d]
    return kv.reshape(kv.shape[0], -1, kv.shape[-1])
