"""The KV pool's size: its shape per model, and how many pages a replica makes.

Pages are as configured (`num_pages`); else, on accelerators, the pool takes
`kv_cache_memory_fraction` of the memory the loaded weights leave on each device (the least any
host has, so every host makes the same pool); on CPUs, where memory is not reported, enough for
every sequence slot at max_model_len. A page holds the keys and values of every model the runner
serves (the served model's, and a draft model's).
"""

from __future__ import annotations

import logging
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.multihost_utils import process_allgather

from engine.backends.base import AttentionBackend, CacheShape
from engine.config import EngineConfig
from engine.formats.checkpoint_config import ModelInfo
from engine.generate.runner import sharding

logger = logging.getLogger(__name__)

GiB = 2**30


def max_model_len(config: EngineConfig, info: ModelInfo) -> int:
    """Tokens per sequence a replica serves: as configured, else the model's own capped at 4096."""
    return config.max_model_len or min(info.max_position_embeddings, 4096)


def cache_shape(info: ModelInfo, layout: sharding.TensorParallelLayout, page_size: int, num_pages: int,
                dtype) -> CacheShape:
    """The KV pool of a replica: every layer, the KV heads as the layout repeats them (all devices')."""
    return CacheShape(info.num_layers, num_pages, page_size, info.num_kv_heads * layout.kv_repeats, info.head_dim,
                      jnp.dtype(dtype), info.values_are_keys)


def pages_for_memory(free_bytes: int, fraction: float, bytes_per_page: int) -> int:
    """KV pages that `fraction` of `free_bytes` holds, one page reserved as scratch included."""
    return int(free_bytes * fraction) // bytes_per_page


def page_bytes_per_device(backend: AttentionBackend, models: Sequence[tuple[ModelInfo, sharding.TensorParallelLayout]],
                          page_size: int, dtype) -> int:
    """Bytes one page takes on each device: the keys and values of every model in `models`
    ((sizes, layout) each), stored as `backend` stores them."""
    return sum(backend.cache_bytes_per_page(cache_shape(info, layout, page_size, 1, dtype)) // layout.size
               for info, layout in models)


def pool_pages(config: EngineConfig, devices, page_bytes: int, max_pages_per_seq: int, max_len: int) -> int:
    """KV pages of the pool on `devices` (see the module docstring), a page taking `page_bytes` on
    each; ValueError that says what to change if fewer than one sequence of `max_len` tokens
    (`max_pages_per_seq` pages) fits."""
    if config.num_pages:
        return config.num_pages
    free = sharding.free_device_memory(devices)
    if free is None:
        return 1 + config.max_num_seqs * max_pages_per_seq
    if jax.process_count() > 1:  # every host must make the same pool: the least any host has room for
        free = 2**20 * int(np.min(process_allgather(np.array([free // 2**20], np.int32))))  # MiB: int32
    pages = pages_for_memory(free, config.kv_cache_memory_fraction, page_bytes)
    if pages < max_pages_per_seq + 1:
        raise ValueError(f"{free / GiB:.2f} GiB left per device after the weights hold {pages} KV pages, "
                         f"fewer than one sequence of max_model_len={max_len} needs "
                         f"({max_pages_per_seq + 1}); lower max_model_len, raise kv_cache_memory_fraction "
                         "or tensor_parallel_size")
    logger.info("KV pool: %d pages of %d tokens (%d tokens, %.2f GiB per device) from %.0f%% of %.2f GiB free",
                pages, config.page_size, pages * config.page_size, pages * page_bytes / GiB,
                100 * config.kv_cache_memory_fraction, free / GiB)
    return pages


def init_cache(backend: AttentionBackend, shape: CacheShape, cache_sharding):
    """The empty KV pool of `shape`, made on the devices as `cache_sharding` splits it."""
    return jax.jit(lambda: backend.init_cache(shape), out_shardings=cache_sharding)()
