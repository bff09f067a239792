"""The tpu backend's Pallas kernel itself (not its reference) on CPUs, in Pallas' TPU interpret
mode: the kernel against JAX's reference on a ragged batch, and engines that run it against
transformers (tests/support/pallas_interpret.py says what the interpreter needed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
from jax.sharding import Mesh

from engine.backends import tpu_kernel
from engine.config import EngineConfig
from engine.generate.engine import LLMEngine
from tests.support.pallas_interpret import (  # noqa: F401
    SIMULATED_TPU,
    interpreted_kernel,
    interpreter_fixes,
)
from tests.support.parity import TIGHT, assert_ragged_parity


@pytest.mark.parametrize("dtype, window, cap", [("float32", None, None), ("bfloat16", None, None),
                                               ("float32", 8, 2.0)])
def test_the_kernel_equals_the_reference_on_a_ragged_batch(interpreter_fixes, dtype, window, cap):  # noqa: F811
    """Three rows (a 10-token prompt chunk over 20 cached tokens, a decode, a 5-token prompt over 33),
    padding after them, heads of 64 stored padded to 128 lanes, 4 query heads over 2 KV heads; and
    over a sliding window of 8 keys with scores soft-capped at 2."""
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
        *a, scale=0.125, mesh=mesh, model_axis="model", device_kind=SIMULATED_TPU, interpret=True,
        sliding_window=window, soft_cap=cap))(q, pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    padded_q = jnp.pad(q, ((0, 0), (0, 0), (0, 128 - head_dim)))
    expected = rpa.ref_ragged_paged_attention(padded_q, pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                              sm_scale=0.125, sliding_window=window, soft_cap=cap)[..., :head_dim]
    assert out.shape == (tokens, heads, head_dim)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out[:16], np.float32), np.asarray(expected[:16], np.float32),
                               atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_an_engine_running_the_kernel_answers_as_transformers_does(checkpoint_factory, interpreted_kernel,  # noqa: F811
                                                                   family):
    """Gemma 2: soft-capped scores, and its sliding layers chosen per layer of the scanned loop;
    Qwen3-MoE: q/k norms and experts around the kernel; gpt-oss: learned sinks (the kernel's copy
    with sinks, engine/backends/tpu_sink_kernel.py) on sliding and full layers; DeepSeek-V3: its
    absorbed latent attention as one KV head (the latent and the RoPE key) under every query head.
    (Other families give the kernel what Llama does; test_engine.py runs them on the tpu backend
    with its reference attention, which the kernel tests above hold the kernel to.)"""
    model_dir = checkpoint_factory(family)
    engine = LLMEngine(EngineConfig(model=str(model_dir), attention_backend="tpu", **TIGHT))
    backend = engine.executor.runner.backend
    assert (backend.name, backend.kernel_target, backend.interpret) == ("tpu", SIMULATED_TPU, True)
    assert engine.executor.runner.cache.pages.shape[-1] == 128  # heads of 16 stored padded for the kernel
    assert_ragged_parity(engine, model_dir)


def test_block_sizes_come_from_the_kernels_table_for_the_named_generation():
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        tuned_block_sizes as tuned,
    )

    bf16 = jnp.bfloat16
    # a tuned entry: 4 query heads over 1 KV head, 128 lanes, pages of 16, 1024 tokens, 8 pages of 16 per row
    expected = tuned.TUNED_BLOCK_SIZES["TPU v6"][("bfloat16", "bfloat16", 4, 1, 128, 16, 1024, 128)]
    assert tpu_kernel.block_sizes("TPU v6 lite", bf16, bf16, 4, 2, 128, 16, 1024, 8) == (min(8, expected[0]),
                                                                                         min(1024, expected[1]))
    assert tpu_kernel.block_sizes("TPU v4", bf16, bf16, 4, 2, 128, 16, 512, 256) == (32, 32)  # v4: untuned defaults
    assert tpu_kernel.block_sizes("TPU v6 lite", bf16, bf16, 4, 2, 128, 16, 8, 256) == (128, 8)  # at most T queries


def test_blocks_that_would_overflow_the_scoped_vmem_are_halved():
    """8 KV heads on one device (v5p at TP 1): the default 128 pages of 16 tokens x 16 combined heads
    x 128 lanes double-buffered in bf16 are 16 MiB alone; 64 pages fit the 12 MiB budget."""
    bf16 = jnp.bfloat16
    assert tpu_kernel._vmem_bytes(128, 32, 16, 16, 32, 128, 4, bf16, bf16) > tpu_kernel.VMEM_BUDGET
    assert tpu_kernel.block_sizes("TPU v5", bf16, bf16, 32, 16, 128, 16, 512, 256) == (64, 32)
    assert tpu_kernel._vmem_bytes(64, 32, 16, 16, 32, 128, 4, bf16, bf16) <= tpu_kernel.VMEM_BUDGET
    # DeepSeek-V3 over 32 chips: one 576-wide latent head (640 lanes) under 4 query heads a chip; 128
    # pages overflowed Mosaic's scoped VMEM when compiled (its per-head temporaries), 64 compile
    assert tpu_kernel.block_sizes("TPU v5", bf16, bf16, 4, 2, 640, 16, 1, 512) == (64, 1)
    assert tpu_kernel.block_sizes("TPU v5", bf16, bf16, 4, 2, 640, 16, 32, 512) == (64, 32)


@pytest.mark.parametrize("kind, generation", [("TPU v4", 4), ("TPU v5 lite", 5), ("TPU v5", 5), ("TPU v6 lite", 6),
                                              ("TPU7x", 7)])
def test_the_generation_comes_from_the_device_kind(kind, generation):
    assert tpu_kernel.tpu_generation(kind) == generation


def test_devices_the_kernel_does_not_know_are_refused():
    with pytest.raises(ValueError, match="'NVIDIA H100' is not a TPU the ragged paged attention kernel knows"):
        tpu_kernel.tpu_generation("NVIDIA H100")
    with pytest.raises(ValueError, match="needs TPU v4 or later, not 'TPU v3'"):
        tpu_kernel.block_sizes("TPU v3", jnp.bfloat16, jnp.bfloat16, 4, 2, 128, 16, 8, 8)


def test_the_reference_runs_sliding_windows_as_transformers_does(checkpoint_factory):
    """Off TPUs the tpu backend runs levanter's reference, which has no sliding window: Gemma 2's
    sliding layers run the xla backend's recurrence over the tpu backend's pages instead."""
    model_dir = checkpoint_factory("gemma2")
    engine = LLMEngine(EngineConfig(model=str(model_dir), attention_backend="tpu", **TIGHT))
    assert (engine.executor.runner.backend.name, engine.executor.runner.backend.kernel_target) == ("tpu", None)
    assert_ragged_parity(engine, model_dir)
