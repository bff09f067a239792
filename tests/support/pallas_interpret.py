"""Running the tpu backend's Pallas kernel on CPUs: Pallas' TPU interpret mode, with two gaps of
JAX 0.10.2's interpreter filled, and engines whose tpu backend interprets the kernel.

The interpreter (jax._src.pallas.mosaic.interpret) simulates a TPU's memories, DMAs and
semaphores, but as released it cannot run JAX's own ragged paged attention kernel:
- a load from a reshaped or bitcast ref (the kernel reads its KV block through
  `ref.reshape(...)` and, for bfloat16, `ref.bitcast(uint32)`) fails: its ranges know only
  indexers ('ReshapeTransform' object has no attribute 'indices');
- a masked store into a slice of a buffer along any dimension but the first is taken for an
  out-of-bounds write (it clears the in-bounds mask along dimension 0 for every dimension).
`interpreter_fixes` wraps the interpreter's `get` (reads the indexed block, then applies the
reshapes and bitcasts to the value, as Mosaic lays them out: a bitcast packs consecutive rows of
the second-minor dimension, the first in the low bits) and `swap` (a masked store as a read, a
merge and an unmasked store). The kernel itself runs unchanged.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter
from jax._src.pallas.mosaic.interpret import utils as interpreter_utils
from jax._src.state import indexing
from jax._src.state import types as state_types

SIMULATED_TPU = "TPU v5 lite"
"""The generation the interpreted kernel is built for (its block sizes)."""


def _bitcast(value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    src, dst = value.dtype.itemsize, dtype.itemsize
    *lead, m, n = value.shape
    if src < dst:
        p = dst // src
        packed = np.ascontiguousarray(value.reshape(*lead, m // p, p, n).swapaxes(-1, -2))
        return packed.view(dtype).reshape(*lead, m // p, n)
    if src > dst:
        p = src // dst
        unpacked = np.ascontiguousarray(value).view(dtype).reshape(*lead, m, n, p)
        return unpacked.swapaxes(-1, -2).reshape(*lead, m * p, n)
    return value.view(dtype)


def _view(value: np.ndarray, transform) -> np.ndarray:
    if isinstance(transform, indexing.NDIndexer):
        return value[interpreter_utils.to_range((transform,))]
    if isinstance(transform, state_types.ReshapeTransform):
        return value.reshape(transform.shape)
    if isinstance(transform, state_types.BitcastTransform):
        return _bitcast(value, np.dtype(transform.dtype))
    raise NotImplementedError(f"the interpreter fixes do not read through {type(transform).__name__}")


def _get_through_views(get):
    @functools.wraps(get)
    def wrapped(token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kwargs):
        indexers = [isinstance(t, indexing.NDIndexer) for t in transforms]
        if all(indexers):
            return get(token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kwargs)
        first = indexers.index(False)
        token, value = get(token, device_id, local_core_id, memory_space, buffer_id, transforms[:first],
                           *args, **kwargs)
        for transform in jax.tree.map(int, transforms[first:]):
            value = _view(value, transform)
        return token, value

    return wrapped


def _swap_masked_as_merge(swap, get):
    @functools.wraps(swap)
    def wrapped(token, device_id, local_core_id, memory_space, buffer_id, transforms, val, mask, **kwargs):
        if mask is None:
            return swap(token, device_id, local_core_id, memory_space, buffer_id, transforms, val, mask, **kwargs)
        token, old = get(token, device_id, local_core_id, memory_space, buffer_id, transforms)
        val, mask = np.asarray(val), np.asarray(mask)
        token, _ = swap(token, device_id, local_core_id, memory_space, buffer_id, transforms,
                        np.where(mask, val, old), None, **kwargs)
        return token, np.where(mask, old, val)

    return wrapped


@pytest.fixture
def interpreter_fixes(monkeypatch):
    """JAX's TPU interpreter with the fixes above, for one test."""
    get = _get_through_views(interpreter.get)
    monkeypatch.setattr(interpreter, "get", get)
    monkeypatch.setattr(interpreter, "swap", _swap_masked_as_merge(interpreter.swap, get))


@pytest.fixture
def interpreted_kernel(monkeypatch, interpreter_fixes):
    """Engines made in this test run the tpu backend's Pallas kernel in TPU interpret mode."""
    from engine.backends.tpu import TpuBackend
    from engine.generate.runner import model_runner

    def select(config, dtype, mesh, model_axis):
        assert config.attention_backend == "tpu", "interpreted_kernel is for engines of the tpu backend"
        return TpuBackend(mesh, model_axis, interpret_as=SIMULATED_TPU)

    monkeypatch.setattr(model_runner, "select_backend", select)
