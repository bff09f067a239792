"""The tpu backend's Pallas kernel itself (not its reference) on CPUs, in Pallas' TPU interpret
mode: the kernel against JAX's reference on a ragged batch, and engines that run it against
transformers (tests/pallas_interpret.py says what the interpreter needed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
from jax.sharding import Mesh
from pallas_interpret import SIMULATED_TPU, interpreted_kernel, interpreter_fixes  # noqa: F401
from parity import TIGHT, assert_greedy_parity

from engine.backends import tpu_kernel
from engine.core.config import EngineConfig
from engine.llm_engine import LLMEngine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernel_equals_the_reference_on_a_ragged_batch(interpreter_fixes, dtype):  # noqa: F811
    """Three rows (a 10-token prompt chunk over 20 cached tokens, a decode, a 5-token prompt over 33),
    padding after them, heads of 64 stored padded to 128 lanes, 4 query heads over 2 KV heads."""
    rng = np.random.default_rng(0)
    dtype = jnp.dtype(dtype)
    tokens, heads, kv_heads, head_dim, page_size, rows, pages_per_row = 24, 4, 2, 64, 16, 8, 4
    q = jnp.asarray(rng.standard_normal((tokens, heads, head_dim)), dtype)
    pages = np.zeros((rows * pages_per_row + 1, page_size, 2 * kv_heads, 128), np.float32)
    pages[..., :head_dim] = rng.standard_normal(pages[..., :head_dim].shape)
    pages = jnp.asarray(pages, dtype)
    kv_lens = jnp.array([30, 21, 38] + [0] * (rows - 3), jnp.int32)
    page_indices = jnp.asarray(1 + rng.permutation(rows * pages_per_row).reshape(rows, pages_per_row), jnp.int32)
    cu_q_lens = jnp.array([0, 10, 11, 16] + [16] * (rows - 3), jnp.int32)
    num_seqs = jnp.array([3], jnp.int32)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))

    out = jax.jit(lambda *a: tpu_kernel.ragged_paged_attention(
        *a, scale=0.125, mesh=mesh, model_axis="model", device_kind=SIMULATED_TPU, interpret=True))(
        q, pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    padded_q = jnp.pad(q, ((0, 0), (0, 0), (0, 128 - head_dim)))
    expected = rpa.ref_ragged_paged_attention(padded_q, pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                              sm_scale=0.125)[..., :head_dim]
    assert out.shape == (tokens, heads, head_dim)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out[:16], np.float32), np.asarray(expected[:16], np.float32),
                               atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_an_engine_running_the_kernel_answers_as_transformers_does(checkpoint_factory, interpreted_kernel,  # noqa: F811
                                                                   family):
    model_dir = checkpoint_factory(family)
    engine = LLMEngine(EngineConfig(model=str(model_dir), attention_backend="tpu", **TIGHT))
    backend = engine.executor.runner.backend
    assert (backend.name, backend.kernel_target, backend.interpret) == ("tpu", SIMULATED_TPU, True)
    assert engine.executor.runner.cache.pages.shape[-1] == 128  # heads of 16 stored padded for the kernel
    assert_greedy_parity(engine, model_dir)
