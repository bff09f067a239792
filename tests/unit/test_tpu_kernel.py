"""The tpu backend's Pallas kernel itself (not its reference) on CPUs, in Pallas' TPU interpret
mode: the kernel against JAX's reference on a ragged batch, and engines that run it against
transformers (tests/support/pallas_interpret.py says what the interpreter needed)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
from jax.sharding import Mesh

from engine.backends import tpu_kernel
from engine.backends.tpu_kernel_modified import ragged_paged_attention_modified
from engine.config import EngineConfig
from engine.formats.checkpoint_config import model_info
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


def ragged_batch(rng, dtype, kv_heads: int, head_dim: int, arrays: int):
    """The ragged batch above: q [24, 4, head_dim] over pages [33, 16, arrays * kv_heads, 128] whose
    heads of `head_dim` are zero-padded to 128 lanes, and the kernel's tables."""
    tokens, heads, page_size, rows, pages_per_row = 24, 4, 16, 8, 4
    q = jnp.asarray(rng.standard_normal((tokens, heads, head_dim)), dtype)
    pages = np.zeros((rows * pages_per_row + 1, page_size, arrays * kv_heads, 128), np.float32)
    pages[..., :head_dim] = rng.standard_normal(pages[..., :head_dim].shape)
    pages = jnp.asarray(pages, dtype)
    kv_lens = jnp.array([30, 21, 38] + [0] * (rows - 3), jnp.int32)
    page_indices = jnp.asarray(1 + rng.permutation(rows * pages_per_row).reshape(rows, pages_per_row), jnp.int32)
    cu_q_lens = jnp.array([0, 10, 11, 16] + [16] * (rows - 3), jnp.int32)
    return q, pages, kv_lens, page_indices, cu_q_lens, jnp.array([3], jnp.int32)


ONE_DEVICE = ("data", "model")


@pytest.mark.parametrize("dtype, window, cap", [("float32", None, None), ("bfloat16", None, None),
                                               ("float32", 8, 2.0)])
def test_the_kernel_reads_keys_as_values_on_a_ragged_batch(interpreter_fixes, dtype, window, cap):  # noqa: F811
    """A cache whose values are its keys (DeepSeek's latent): pages [page, slot, 1, 128] of keys alone,
    4 query heads over the one KV head, heads of 72 padded to 128 lanes: the modified kernel equals
    JAX's reference over the same keys stored interleaved as keys and values."""
    dtype = jnp.dtype(dtype)
    q, keys, *tables = ragged_batch(np.random.default_rng(1), dtype, kv_heads=1, head_dim=72, arrays=1)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ONE_DEVICE)
    out = jax.jit(lambda *a: tpu_kernel.ragged_paged_attention(
        *a, scale=0.125, mesh=mesh, model_axis="model", device_kind=SIMULATED_TPU, interpret=True,
        sliding_window=window, soft_cap=cap, values_are_keys=True))(q, keys, *tables)
    interleaved = jnp.repeat(keys, 2, axis=2)  # the key at 0, the same vector as the value at 1
    expected = rpa.ref_ragged_paged_attention(jnp.pad(q, ((0, 0), (0, 0), (0, 128 - 72))), interleaved, *tables,
                                              sm_scale=0.125, sliding_window=window, soft_cap=cap)[..., :72]
    assert out.shape == (24, 4, 72)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out[:16], np.float32), np.asarray(expected[:16], np.float32),
                               atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_modified_kernel_without_sinks_gives_the_originals_numbers(interpreter_fixes, dtype):  # noqa: F811
    """Interleaved keys and values, no sinks: the modified copy's recurrence starts as JAX's kernel's
    does, so both give the same bits on the same blocks."""
    q, pages, *tables = ragged_batch(np.random.default_rng(2), jnp.dtype(dtype), kv_heads=2, head_dim=128, arrays=2)
    blocks = dict(sm_scale=0.125, num_kv_pages_per_block=2, num_queries_per_block=8)

    def both(*args):
        with pltpu.force_tpu_interpret_mode():
            return rpa.ragged_paged_attention(*args, **blocks), ragged_paged_attention_modified(*args, **blocks)

    original, modified = jax.jit(both)(q, pages, *tables)
    np.testing.assert_array_equal(np.asarray(modified[:16], np.float32), np.asarray(original[:16], np.float32))


def test_keys_that_are_values_need_one_kv_head_a_device():
    q, keys, *tables = ragged_batch(np.random.default_rng(0), jnp.float32, kv_heads=2, head_dim=128, arrays=1)
    with pytest.raises(ValueError, match="one KV head per device .* not 2"):
        ragged_paged_attention_modified(q, keys, *tables, values_are_keys=True, num_kv_pages_per_block=2,
                                        num_queries_per_block=8)


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_an_engine_running_the_kernel_answers_as_transformers_does(checkpoint_factory, interpreted_kernel,  # noqa: F811
                                                                   family):
    """Gemma 2: soft-capped scores, and its sliding layers chosen per layer of the scanned loop;
    Qwen3-MoE: q/k norms and experts around the kernel; gpt-oss: learned sinks (the kernel's copy
    with sinks, engine/backends/tpu_kernel_modified.py) on sliding and full layers; DeepSeek-V3: its
    absorbed latent attention as one KV head (the latent and the RoPE key) under every query head, its
    keys alone in the cache (the modified kernel reads them as the values).
    (Other families give the kernel what Llama does; test_engine.py runs them on the tpu backend
    with its reference attention, which the kernel tests above hold the kernel to.)"""
    model_dir = checkpoint_factory(family)
    engine = LLMEngine(EngineConfig(model=str(model_dir), attention_backend="tpu", **TIGHT))
    backend = engine.executor.runner.backend
    assert (backend.name, backend.kernel_target, backend.interpret) == ("tpu", SIMULATED_TPU, True)
    cache = engine.executor.runner.cache
    assert cache.pages.shape[-1] == 128  # heads of 16 (DeepSeek's latent and RoPE key: 64) stored padded
    kv_heads = model_info(model_dir).num_kv_heads
    assert cache.pages.shape[2] == (1 if family == "deepseek_v3" else 2 * kv_heads)  # the latent's keys alone
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
    # its keys alone (values_are_keys): half the KV block and one head read out of it, so 128 pages
    # fit (and compile: test_the_keys_only_kernel_compiles_for_deepseek_v3s_heads), 256 do not
    assert tpu_kernel.block_sizes("TPU v5", bf16, bf16, 4, 1, 640, 16, 32, 512, values_are_keys=True) == (128, 32)
    assert tpu_kernel._vmem_bytes(256, 32, 16, 1, 4, 640, 4, bf16, bf16, arrays=1) > tpu_kernel.VMEM_BUDGET


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


TPU_PYTHON = Path(__file__).parents[2] / ".venv-tpu" / "bin" / "python"
COMPILE_KEYS_ONLY = """
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from engine.backends import tpu_kernel

devices = sorted(topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices, key=lambda d: d.id)
mesh = Mesh(np.array(devices).reshape(1, 4), ("data", "model"))
arg = lambda shape, dtype, spec=P(): jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
for tokens in (1, 32):
    args = (arg((tokens, 16, 576), jnp.bfloat16, P(None, "model", None)),
            arg((4096, 16, 4, 640), jnp.bfloat16, P(None, None, "model", None)), arg((8,), jnp.int32),
            arg((8, 512), jnp.int32), arg((9,), jnp.int32), arg((1,), jnp.int32))
    attend = lambda *a: tpu_kernel.ragged_paged_attention(*a, scale=0.1, mesh=mesh, model_axis="model",
                                                          device_kind=devices[0].device_kind, values_are_keys=True)
    text = jax.jit(attend).lower(*args).compile().as_text()
    assert "ragged_paged_attention_modified_kernel" in text
    blocks = tpu_kernel.block_sizes(devices[0].device_kind, jnp.bfloat16, jnp.bfloat16, 4, 1, 640, 16, tokens, 512,
                                    values_are_keys=True)
    print("compiled", devices[0].device_kind, "tokens", tokens, "blocks", blocks)
"""


def test_the_keys_only_kernel_compiles_for_deepseek_v3s_heads():
    """Deviceless: libtpu (.venv-tpu) compiles the modified kernel over a keys-only cache as
    DeepSeek-V3 splits over chips (4 query heads a chip over the one 576-wide latent head, stored in
    640 lanes, bfloat16, pages of 16) on a v5p slice at TP 4, for decode and for 32-token blocks,
    with the block sizes `block_sizes` picks (Mosaic refuses blocks that overflow its VMEM)."""
    if not TPU_PYTHON.is_file():
        pytest.fail(f"{TPU_PYTHON} is missing: run scripts/setup.sh (it installs libtpu there)")
    done = subprocess.run([str(TPU_PYTHON), "-c", COMPILE_KEYS_ONLY], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).parents[2], env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["compiled TPU v5 tokens 1 blocks (128, 1)",
                                           "compiled TPU v5 tokens 32 blocks (128, 32)"]
