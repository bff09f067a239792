"""Whether a config fits before anything loads: what one replica's model and KV pool take per
device, from config.json alone.

The same arithmetic the runner runs at start: the tensor-parallel layout (engine.generate.runner.sharding),
the weights as the layout splits them (every array of the levanter model `abstract_model` builds,
its axes split on the model axis as the layout's mapping says), the attention backend's bytes per
KV page (`AttentionBackend.cache_bytes_per_page`) and the pool that `kv_cache_memory_fraction` of
the memory left after the weights holds (engine.generate.runner.kv_pool). Nothing is loaded or
allocated, so the runner checks a config before it loads a weight (`check_fits`), and the offline
tools (engine.tools) size a model for a TPU slice (`smallest_tensor_parallel`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Optional

import haliax as hax
import jax
import numpy as np

from engine.backends.base import AttentionBackend
from engine.formats.checkpoint_config import model_info
from engine.formats.model_sources import resolve_model
from engine.generate.runner import sharding
from engine.generate.runner.kv_pool import GiB, cache_shape, max_model_len, pages_for_memory
from engine.generate.runner.loader import serving_model
from engine.models.loading import abstract_model, resolve_dtype


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    """One model on `tensor_parallel_size` devices of `memory_bytes` each: all figures per device."""

    tensor_parallel_size: int
    weight_bytes: int
    kv_bytes_per_page: int
    memory_bytes: int
    page_size: int
    max_model_len: int
    kv_cache_memory_fraction: float
    num_pages: int = 0
    """Configured KV pages (0: from the memory the weights leave, as the engine sizes its pool)."""
    loading_extra_bytes: int = 0
    """What loading holds for a while beyond the weights' share (`_loading_extra`)."""
    loading_extra_why: str = ""
    """Why loading holds `loading_extra_bytes`, for the message."""

    @property
    def pages(self) -> int:
        """KV pages in the pool (one is the scratch page)."""
        if self.num_pages:
            return self.num_pages
        free = max(0, self.memory_bytes - self.weight_bytes)
        return pages_for_memory(free, self.kv_cache_memory_fraction, self.kv_bytes_per_page)

    @property
    def kv_bytes(self) -> int:
        return self.pages * self.kv_bytes_per_page

    @property
    def kv_tokens(self) -> int:
        """Tokens the pool holds (the scratch page excluded)."""
        return max(0, self.pages - 1) * self.page_size

    def sequences_at(self, context_len: int) -> int:
        """Sequences of `context_len` tokens the pool holds at once."""
        return max(0, self.pages - 1) // math.ceil(context_len / self.page_size)

    @property
    def pages_per_sequence(self) -> int:
        return math.ceil(self.max_model_len / self.page_size)

    def problem(self) -> Optional[str]:
        """Why this does not fit (None if it does): the weights, or a pool without room for one
        sequence of max_model_len (a configured pool: weights and pool together)."""
        gib = lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
        if self.weight_bytes >= self.memory_bytes:
            return (f"the weights take {gib(self.weight_bytes)} per device at tensor_parallel_size="
                    f"{self.tensor_parallel_size}, more than the {gib(self.memory_bytes)} a device has")
        if self.weight_bytes + self.loading_extra_bytes >= self.memory_bytes:
            return (f"loading takes {gib(self.weight_bytes + self.loading_extra_bytes)} per device at "
                    f"tensor_parallel_size={self.tensor_parallel_size} ({self.loading_extra_why}), more than the "
                    f"{gib(self.memory_bytes)} a device has")
        if self.num_pages and self.weight_bytes + self.kv_bytes > self.memory_bytes:
            return (f"the weights ({gib(self.weight_bytes)}) and num_pages={self.num_pages} KV pages "
                    f"({gib(self.kv_bytes)}) take more than the {gib(self.memory_bytes)} a device has")
        if self.pages < self.pages_per_sequence + 1:
            return (f"after the weights ({gib(self.weight_bytes)} of {gib(self.memory_bytes)} per device) the KV "
                    f"pool holds {self.pages} pages of {self.page_size} tokens, fewer than one sequence of "
                    f"max_model_len={self.max_model_len} needs ({self.pages_per_sequence + 1})")
        return None


def weight_bytes_per_device(model, axis_mapping: dict[str, str], model_axis: str, size: int) -> int:
    """Bytes of `model`'s arrays (named arrays, concrete or shapes only) on one device when every
    axis that `axis_mapping` puts on `model_axis` is split `size` ways."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(model, is_leaf=lambda x: isinstance(x, hax.NamedArray)):
        if isinstance(leaf, hax.NamedArray):
            shape = [ax.size // size if axis_mapping.get(ax.name) == model_axis else ax.size for ax in leaf.axes]
            total += int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
        elif hasattr(leaf, "shape"):
            total += int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
    return total


def plan(config, tensor_parallel_size: int, memory_bytes: int, cache_bytes_per_page=None) -> CapacityPlan:
    """The plan of `config`'s model (config.json only) on `tensor_parallel_size` devices of
    `memory_bytes` each. `cache_bytes_per_page(CacheShape)`: the attention backend's (default: the
    KV cache dtype's bytes with heads as they are, as the xla backend and the tpu backend off TPUs
    store them; pass the backend's own). ValueError if the model cannot split that many ways."""
    info = model_info(config.model)
    dtype = resolve_dtype(config.dtype, info)
    bytes_per_page = cache_bytes_per_page or AttentionBackend().cache_bytes_per_page
    weights, per_page = _served(config, config.model, info, tensor_parallel_size, dtype, bytes_per_page)
    draft = _draft_model(config)
    if draft is not None:  # a draft model's weights beside, its keys and values in every page
        draft_weights, draft_page = _served(config, draft, model_info(draft), tensor_parallel_size, dtype,
                                            bytes_per_page)
        weights, per_page = weights + draft_weights, per_page + draft_page
    layout = sharding.plan_layout(info, tensor_parallel_size, config.expert_parallel_size)
    extra, why = _loading_extra(info, layout, dtype, config.quantization is not None)
    return CapacityPlan(layout.size, weights, per_page, memory_bytes, config.page_size,
                        max_model_len(config, info), config.kv_cache_memory_fraction, config.num_pages, extra, why)


def _served(config, path: str, info, tensor_parallel_size: int, dtype: str, bytes_per_page) -> tuple[int, int]:
    """(weight bytes, KV bytes per page) per device of the model at `path` (sizes `info`) as
    `config` serves it over `tensor_parallel_size` devices."""
    layout = sharding.plan_layout(info, tensor_parallel_size, config.expert_parallel_size)
    model, _ = abstract_model(path, dtype, lambda m: serving_model(m, path, info, layout, True,
                                                                  quantization=config.quantization),
                              layout.split_parts)
    shape = cache_shape(info, layout, config.page_size, 1, config.kv_cache_dtype or dtype)
    return (weight_bytes_per_device(model, layout.axis_mapping, sharding.MODEL_AXIS, layout.size),
            bytes_per_page(shape) // layout.size)


def _draft_model(config) -> Optional[str]:
    """The local directory of the config's draft model (speculative decoding; planning reads its
    config.json alone), or None."""
    path = config.draft_model
    if path is None or Path(path).is_dir():
        return path
    return str(resolve_model(path))


def _loading_extra(info, layout, dtype, quantized: bool) -> tuple[int, str]:
    """(bytes a device holds while loading beyond its share of the served weights, why): with KV
    heads repeated, the k and v projections load whole on every device and are repeated whole
    before they split. Quantized weights are made on the host CPU and placed as served
    (engine.generate.runner.loader): the devices hold nothing more."""
    if quantized or layout.kv_repeats == 1:
        return 0, ""
    whole = info.num_layers * 2 * info.hidden_size * info.num_kv_heads * info.head_dim * np.dtype(dtype).itemsize
    return ((1 + layout.kv_repeats) * whole - layout.kv_repeats * whole // layout.size,
            "the k and v projections load whole, then are repeated for the devices")


def tensor_parallel_sizes(config, devices: int) -> list[int]:
    """The sizes up to `devices` the model's heads split over, smallest first."""
    heads = model_info(config.model).num_heads
    return [size for size in range(1, devices + 1) if heads % size == 0]


def smallest_tensor_parallel(config, memory_bytes: int, devices: int,
                             cache_bytes_per_page=None) -> Optional[CapacityPlan]:
    """The plan with the fewest of `devices` devices that fits, or None if none does."""
    for size in tensor_parallel_sizes(config, devices):
        try:
            candidate = plan(config, size, memory_bytes, cache_bytes_per_page)
        except ValueError:  # the MLP or the KV heads do not split this many ways
            continue
        if candidate.problem() is None:
            return candidate
    return None


def check_fits(config, memory_bytes: int, devices: int, cache_bytes_per_page=None) -> CapacityPlan:
    """`config`'s plan on devices of `memory_bytes` each; ValueError that says what to change if
    it does not fit (called before a single weight is loaded)."""
    current = plan(config, config.tensor_parallel_size, memory_bytes, cache_bytes_per_page)
    problem = current.problem()
    if problem is None:
        return current
    better = smallest_tensor_parallel(config, memory_bytes, devices, cache_bytes_per_page)
    if better is not None and better.tensor_parallel_size > current.tensor_parallel_size:
        advice = f"set tensor_parallel_size: {better.tensor_parallel_size} (it fits {better.kv_tokens} KV tokens)"
    else:
        dtype = resolve_dtype(config.dtype, model_info(config.model))
        weights_fit = current.weight_bytes < memory_bytes
        options = ["lower max_model_len"] if weights_fit else []
        if dtype != "bfloat16":
            options.append("set dtype: bfloat16")
        if (config.kv_cache_dtype or dtype) != "bfloat16" and weights_fit:
            options.append("set kv_cache_dtype: bfloat16")
        options.append(f"use more devices (no tensor_parallel_size up to the {devices} here fits)")
        advice = ", ".join(options[:-1]) + (" or " if len(options) > 1 else "") + options[-1]
    if config.quantization is None:  # int8 weights at the same size, about half the bytes
        int8 = plan(dataclasses.replace(config, quantization="int8"), config.tensor_parallel_size, memory_bytes,
                    cache_bytes_per_page)
        if int8.problem() is None:
            advice += f"; or set quantization: int8 (it fits {int8.kv_tokens} KV tokens)"
    raise ValueError(f"the model does not fit: {problem}; {advice}")
