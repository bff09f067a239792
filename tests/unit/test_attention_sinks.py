"""Attention sinks (gpt-oss's) on every attention backend, against a dense numpy reference of
transformers' `eager_attention_forward` for gpt-oss: query head h = kv_head * G + g has a learned
logit sinks[kv_head, g]; p_j = exp(s_j - m) / (sum_j exp(s_j - m) + exp(sink - m)) with
m = max(max_j s_j, sink) over the keys the query sees (causal, within the window where the layer
slides, soft-capped scores), and the sink adds no value.

Each backend's `attend` runs two steps of one layer (of two) over one cache: a prefill of two
prompts, then a mixed step (a decode row, a chunk continuing the second prompt, a fresh prompt)
with padding tokens and a padding row after them. The cpu kernel on both vector widths, over
windows and soft-caps, is in test_cpu_kernels.py; here also the Pallas kernel interpreted on CPUs
and compiled for TPUs, and the KV-head repetition of tensor parallelism regrouping the sinks."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from engine.backends import tpu_kernel
from engine.backends.base import KV_AXES, Q_AXES, CacheShape, LayerAttention
from engine.backends.cpu import kernels as cpu_kernels
from engine.backends.cpu.backend import CpuBackend
from engine.backends.tpu import TpuBackend
from engine.backends.xla import XlaBackend
from engine.step.plan import StepInputs
from tests.support.pallas_interpret import SIMULATED_TPU, interpreter_fixes  # noqa: F401

KV_HEADS, GROUP, DIM, PAGE, TABLE, ROWS, LAYERS, NUM_PAGES = 2, 3, 16, 16, 4, 4, 2, 16
SCALE = 0.25
SEQUENCES = 3
PREFILL = [(0, 0, 20), (1, 0, 5)]  # (sequence, first position, tokens) per row
MIXED = [(0, 20, 1), (1, 5, 4), (2, 0, 3)]


def reference(q, keys, values, queries, sinks, window=None, softcap=None):
    """The dense formula in float64: q f[T, H, G, D] of the (sequence, position) `queries`, each
    sequence's keys and values f[N, H, D]; sinks f[H, G] or None."""
    out = np.zeros(q.shape)
    for t, (seq, pos) in enumerate(queries):
        first = 0 if window is None else max(0, pos + 1 - window)
        k, v = keys[seq][first:pos + 1].astype(np.float64), values[seq][first:pos + 1].astype(np.float64)
        scores = SCALE * np.einsum("hgd,nhd->hgn", q[t].astype(np.float64), k)
        if softcap is not None:
            scores = softcap * np.tanh(scores / softcap)
        top = scores.max(-1) if sinks is None else np.maximum(scores.max(-1), sinks)
        weights = np.exp(scores - top[..., None])
        denominator = weights.sum(-1) + (0.0 if sinks is None else np.exp(sinks - top))
        out[t] = np.einsum("hgn,nhd->hgd", weights / denominator[..., None], v)
    return out


def step_inputs(rows, tables, tokens: int) -> StepInputs:
    """One step of `rows` (sequence, first position, tokens) packed, padding rows after them up to
    ROWS and padding tokens up to `tokens` (in the scratch page 0, on the last row)."""
    positions, kv_dest, token_row, q_start, q_lens, kv_lens = [], [], [], [], [], []
    for r, (seq, start, count) in enumerate(rows):
        q_start.append(len(positions))
        q_lens.append(count)
        kv_lens.append(start + count)
        for pos in range(start, start + count):
            positions.append(pos)
            kv_dest.append(tables[seq][pos // PAGE] * PAGE + pos % PAGE)
            token_row.append(r)
    real, pad_rows = len(positions), ROWS - len(rows)
    page_table = np.zeros((ROWS, TABLE), np.int32)
    page_table[:len(rows)] = [tables[seq] for seq, _, _ in rows]
    pad = tokens - real
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return StepInputs(
        tokens=np.zeros(tokens, np.int32), positions=i32(positions + [0] * pad),
        kv_dest=i32(kv_dest + list(range(pad))), prev_slot=np.full(tokens, -1, np.int32),
        token_row=i32(token_row + [ROWS - 1] * pad), page_table=page_table, kv_lens=i32(kv_lens + [0] * pad_rows),
        q_start=i32(q_start + [real] * pad_rows), q_lens=i32(q_lens + [0] * pad_rows),
        sample_index=np.zeros(ROWS, np.int32), adapter=np.full(ROWS, -1, np.int32), long_rope=np.zeros(ROWS, np.bool_))


class Scenario:
    """Random keys, values and queries of three sequences, their pages, and the two steps."""

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        lengths = [21, 9, 3]
        self.keys = [rng.standard_normal((n, KV_HEADS, DIM)).astype(np.float32) for n in lengths]
        self.values = [rng.standard_normal((n, KV_HEADS, DIM)).astype(np.float32) for n in lengths]
        self.queries = [rng.standard_normal((n, KV_HEADS, GROUP, DIM)).astype(np.float32) for n in lengths]
        self.tables = (1 + rng.permutation(NUM_PAGES - 1)[:SEQUENCES * TABLE]).reshape(SEQUENCES, TABLE).tolist()
        self.sinks = (rng.standard_normal((KV_HEADS, GROUP)) * 2.0).astype(np.float32)
        self.sinks[0, 1], self.sinks[1, 2] = 6.0, -30.0  # one sink above most scores, one far below

    def step(self, rows, tokens: int):
        """(inputs, q, k, v, the real tokens' (sequence, position)) of one step."""
        inputs = step_inputs(rows, self.tables, tokens)
        at = [(seq, pos) for seq, start, count in rows for pos in range(start, start + count)]
        pad = tokens - len(at)

        def gather(arrays):
            x = np.stack([arrays[seq][pos] for seq, pos in at])
            return np.concatenate([x, np.zeros((pad, *x.shape[1:]), np.float32)])

        return inputs, gather(self.queries), gather(self.keys), gather(self.values), at


def run_two_steps(backend, scenario: Scenario, *, window=None, slides=False, softcap=None, sinks=True):
    """The outputs of the prefill step's and the mixed step's real tokens, and the reference's."""
    cache = backend.init_cache(CacheShape(LAYERS, NUM_PAGES, PAGE, KV_HEADS, DIM, jnp.float32))

    @jax.jit
    def attend(cache, inputs, q, k, v, sink_logits, slides):
        how = LayerAttention(SCALE, softcap, window, slides,
                             None if sink_logits is None else hax.named(sink_logits, ("kv_head", "q_heads_per_group")))
        o, cache = backend.attend(cache, 1, hax.named(q, Q_AXES), hax.named(k, KV_AXES), hax.named(v, KV_AXES), how,
                                  backend.begin_step(inputs))
        return o.rearrange(Q_AXES).array, cache

    got, want = [], []
    for rows, tokens in ((PREFILL, 32), (MIXED, 16)):
        inputs, q, k, v, at = scenario.step(rows, tokens)
        o, cache = attend(cache, StepInputs(*map(jnp.asarray, inputs)), q, k, v,
                          scenario.sinks if sinks else None, jnp.asarray(slides))
        got.append(np.asarray(o, np.float32)[:len(at)])
        want.append(reference(q[:len(at)], scenario.keys, scenario.values, at, scenario.sinks if sinks else None,
                              window if slides else None, softcap))
    return got, want


CASES = [pytest.param(dict(), id="causal"),
         pytest.param(dict(window=6, slides=True), id="sliding-window"),
         pytest.param(dict(window=6, slides=False), id="a-layer-that-does-not-slide"),
         pytest.param(dict(softcap=1.5), id="soft-capped")]


def single_device_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))


def assert_steps_match(got, want, tolerance=1e-5):
    for name, g, w in zip(("prefill step", "mixed step"), got, want):
        np.testing.assert_allclose(g, w, rtol=tolerance, atol=tolerance, err_msg=name)


@pytest.mark.parametrize("case", CASES)
def test_the_xla_backend_attends_with_sinks(case):
    assert_steps_match(*run_two_steps(XlaBackend("cpu"), Scenario(), **case))


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs an x86 CPU with AVX2 + FMA and g++")
@pytest.mark.parametrize("case", CASES)
def test_the_cpu_backend_attends_with_sinks(case):
    assert_steps_match(*run_two_steps(CpuBackend(jnp.float32, chooser=None), Scenario(), **case))


@pytest.mark.parametrize("case", CASES)
def test_the_tpu_backends_reference_attends_with_sinks(case):
    """Off TPUs: levanter's reference has no sinks (nor windows); such layers run the xla
    backend's recurrence over the tpu backend's pages."""
    assert_steps_match(*run_two_steps(TpuBackend(single_device_mesh(), "model"), Scenario(), **case))


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3]])
def test_the_tpu_backends_kernel_attends_with_sinks(interpreter_fixes, case):  # noqa: F811
    """The Pallas kernel with sinks (engine.backends.tpu_kernel_modified) in TPU interpret mode, heads of
    16 stored padded to 128 lanes, the window chosen per layer as in a scanned loop (a traced bool)."""
    backend = TpuBackend(single_device_mesh(), "model", interpret_as=SIMULATED_TPU)
    assert_steps_match(*run_two_steps(backend, Scenario(), **case))


@pytest.mark.parametrize("backend", ["xla", "tpu-reference"])
def test_without_sinks_a_backend_attends_as_the_plain_softmax(backend):
    """sinks=None: the plain formula (and sinks change the answer: the test above is not vacuous)."""
    made = XlaBackend("cpu") if backend == "xla" else TpuBackend(single_device_mesh(), "model")
    got, want = run_two_steps(made, Scenario(), sinks=False)
    assert_steps_match(got, want)
    with_sinks, _ = run_two_steps(made, Scenario())
    assert np.abs(with_sinks[1] - got[1]).max() > 0.1


def test_the_sink_kernel_equals_the_dense_formula_on_a_ragged_batch(interpreter_fixes):  # noqa: F811
    """The kernel alone in bfloat16 (its strided loads of packed keys and values), 8 query heads per
    KV head (gpt-oss's grouping), several query blocks and KV blocks per row, rows packed as the
    tpu backend packs them."""
    rng = np.random.default_rng(3)
    heads, kv_heads, head_dim, page_size, rows, per_row = 16, 2, 64, 16, 6, 4
    kv_lens, q_lens = [40, 17, 64, 3], [9, 1, 30, 3]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
    tokens = 48
    q = rng.standard_normal((tokens, heads, head_dim)).astype(np.float32)
    pages = np.zeros((rows * per_row + 1, page_size, 2 * kv_heads, 128), np.float32)
    pages[..., :head_dim] = rng.standard_normal(pages[..., :head_dim].shape)
    q, pages = (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (q, pages))
    page_indices = (1 + rng.permutation(rows * per_row).reshape(rows, per_row)).astype(np.int32)
    sinks = (rng.standard_normal(heads) * 2).astype(np.float32)
    padded = lambda x, n: np.asarray(list(x) + [x[-1] if n == rows + 1 else 0] * (n - len(x)), np.int32)  # noqa: E731
    args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(pages, jnp.bfloat16), jnp.asarray(padded(kv_lens, rows)),
            jnp.asarray(page_indices), jnp.asarray(padded(cu, rows + 1)), jnp.array([len(kv_lens)], jnp.int32))
    for window in (None, 12):
        out = jax.jit(lambda *a, window=window: tpu_kernel.ragged_paged_attention(
            *a, scale=SCALE, mesh=single_device_mesh(), model_axis="model", device_kind=SIMULATED_TPU, interpret=True,
            sliding_window=window, sinks=jnp.asarray(sinks)))(*args)
        keys, values = ([pages[page_indices[r], :, parity::2, :head_dim].reshape(-1, kv_heads, head_dim)
                         for r in range(len(kv_lens))] for parity in (0, 1))
        at = [(r, kv_lens[r] - q_lens[r] + i) for r in range(len(kv_lens)) for i in range(q_lens[r])]
        grouped = q[:len(at)].reshape(len(at), kv_heads, heads // kv_heads, head_dim)
        want = reference(grouped, keys, values, at, sinks.reshape(kv_heads, -1), window)
        np.testing.assert_allclose(np.asarray(out[:len(at)], np.float32).reshape(want.shape), want, atol=2e-2,
                                   rtol=2e-2, err_msg=f"window {window}")


TPU_PYTHON = Path(__file__).parents[2] / ".venv-tpu" / "bin" / "python"
COMPILE_FOR_TPUS = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from engine.backends import tpu_kernel

for topology, tp in (("v5e:2x2", 4), ("v6e:2x2", 1)):
    devices = sorted(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices, key=lambda d: d.id)
    mesh = Mesh(np.array(devices[:tp]).reshape(1, tp), ("data", "model"))
    heads, kv_heads = 8 * tp, tp  # gpt-oss's 8 query heads per KV head
    arg = lambda shape, dtype, spec=P(): jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
    args = (arg((64, heads, 64), jnp.bfloat16, P(None, "model", None)),
            arg((128, 16, 2 * kv_heads, 128), jnp.bfloat16, P(None, None, "model", None)), arg((8,), jnp.int32),
            arg((8, 16), jnp.int32), arg((9,), jnp.int32), arg((1,), jnp.int32), arg((heads,), jnp.float32, P("model")))
    for window in (None, 128):
        attend = lambda q, p, l, i, c, n, s, window=window: tpu_kernel.ragged_paged_attention(
            q, p, l, i, c, n, scale=0.125, mesh=mesh, model_axis="model", device_kind=devices[0].device_kind,
            sliding_window=window, sinks=s)
        text = jax.jit(attend).lower(*args).compile().as_text()
        assert "ragged_paged_attention_modified_kernel" in text
        print("compiled", devices[0].device_kind, "tp", tp, "window", window)
"""


def test_the_sink_kernel_compiles_for_tpus():
    """Deviceless: libtpu (.venv-tpu) compiles the kernel with sinks for a v5e slice at TP 4 (its
    sinks split by head as the queries are) and one v6e chip, with and without a window."""
    if not TPU_PYTHON.is_file():
        pytest.fail(f"{TPU_PYTHON} is missing: run scripts/setup.sh (it installs libtpu there)")
    done = subprocess.run([str(TPU_PYTHON), "-c", COMPILE_FOR_TPUS], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).parents[2], env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.split("\n")[:4] == [f"compiled TPU v{v} tp {tp} window {w}" for v, tp in (("5 lite", 4),
                                           ("6 lite", 1)) for w in (None, 128)]


def test_repeating_kv_heads_regroups_the_sinks_as_the_queries():
    """TP above the KV heads repeats each KV head; query head h * G + g keeps its sink: the sinks
    in (kv_head, q_heads_per_group) order are the same sequence, regrouped (K * r, G / r)."""
    from levanter.layers.attention import AttentionConfig, AttentionWithSink

    from engine.generate.runner import sharding

    Embed = hax.Axis("embed", 32)
    config = AttentionConfig(Embed=Embed, num_heads=8, num_kv_heads=2, head_dim=8)
    attn = AttentionWithSink.init(config, key=jax.random.PRNGKey(0))
    sinks = hax.named(jnp.arange(8, dtype=jnp.float32).reshape(2, 4), ("kv_head", "q_heads_per_group"))
    repeated = sharding.repeat_kv_heads(dataclasses.replace(attn, sinks=sinks), 2)
    assert repeated.sinks.axes == (hax.Axis("kv_head", 4), hax.Axis("q_heads_per_group", 2))
    assert repeated.sinks.array.reshape(-1).tolist() == list(range(8))
