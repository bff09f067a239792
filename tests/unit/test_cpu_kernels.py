"""The CPU kernels against numpy: matmul (float32, bfloat16, int8 and float8 weights, every row/depth
tail), PackedLinear against haliax's Linear and the int8 and FP8 Linears, FusedLinear against its
parts, silu_mul against silu(g) * u, argmax against numpy's, paged attention against a dense reference (with sliding
windows, soft-caps and attention sinks) and, over a mixed step's per-token tables, against the XLA path's masked decode
and causal prefill einsums."""

from __future__ import annotations

import functools

import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.backends.cpu import kernels as cpu_kernels
from engine.backends.cpu.kernels import (
    FusedLinear,
    PackedLinear,
    argmax,
    grouped_matmul,
    matmul,
    pack,
    paged_attention,
    silu_mul,
    xla_matmul,
)

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs an x86 CPU with AVX2 + FMA and g++")


WIDTHS = [False, pytest.param(True, marks=pytest.mark.skipif(not cpu_kernels.wide_vectors(),
                                                            reason="needs AVX-512"))]


@pytest.mark.parametrize("m,k,n", [(1, 768, 2048), (1, 1027, 32), (2, 301, 16), (5, 100, 48), (7, 1030, 256),
                                   (13, 64, 16), (100, 600, 96), (200, 40, 32), (131, 1100, 48)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("wide", WIDTHS)
def test_matmul_equals_numpy(m, k, n, dtype, wide):
    """Every row-tile size (1-6 on 8 lanes, the 1- and 2-row ones with depth tails their partial
    sums do not cover; 1-12 on 16), one row tile streaming whole panels and several sharing depth
    blocks, an odd panel count."""
    rng = np.random.default_rng(m * 1000 + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    w_rounded = np.asarray(jnp.asarray(w).astype(dtype).astype(jnp.float32))  # what the kernel multiplies by
    got = np.asarray(jax.jit(functools.partial(matmul, wide=wide))(jnp.asarray(x), pack(jnp.asarray(w), dtype)))
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, x.astype(np.float64) @ w_rounded, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not cpu_kernels.wide_vectors(), reason="needs AVX-512")
@pytest.mark.parametrize("m", [17, 40, 130])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_many_row_products_are_the_same_on_both_vector_widths(m, dtype):
    """Products of more than 16 rows run on 16-lane tiles of up to 12 rows where the CPU has
    AVX-512, else on 8-lane tiles of up to 6: the same float32 sums in the same order (row counts
    whose 8-lane tiling has no 1- or 2-row tile, which sums in parts), over two depth blocks and
    an odd number of panels, so the outputs are equal bit for bit."""
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, 1100)).astype(np.float32))
    w = pack(jnp.asarray(rng.standard_normal((1100, 48)) * (30 if dtype == jnp.int8 else 0.05)), dtype)
    wide, narrow = (jax.jit(functools.partial(matmul, wide=flag))(x, w) for flag in (True, False))
    np.testing.assert_array_equal(np.asarray(wide), np.asarray(narrow))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xla_matmul_reads_the_plain_matrix_either_way_round(dtype):
    """XLA's path (what matmul_choice may pick per shape) multiplies x in the weights' dtype, by
    w[K, N] or, out first, w[N, K] (a tied LM head's embedding table)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((37, 300)).astype(np.float32)
    w = (rng.standard_normal((300, 96)) * 0.05).astype(np.float32)
    rounded = [np.asarray(jnp.asarray(a).astype(dtype).astype(jnp.float32), np.float64) for a in (x, w)]
    for got in (jax.jit(xla_matmul)(jnp.asarray(x), jnp.asarray(w, dtype)),
                jax.jit(xla_matmul, static_argnums=2)(jnp.asarray(x), jnp.asarray(w.T, dtype), True)):
        assert got.shape == (37, 96) and got.dtype == np.float32
        np.testing.assert_allclose(np.asarray(got), rounded[0] @ rounded[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8])
def test_xla_matmul_in_float32_keeps_the_activations_unrounded(dtype):
    """`f32=True` widens the weight (exactly) and multiplies float32 activations: the kernel's
    arithmetic, either layout."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((70, 300)).astype(np.float32)
    w = rng.integers(-127, 128, (300, 96)).astype(np.int8) if dtype == jnp.int8 else \
        (rng.standard_normal((300, 96)) * 0.05).astype(np.float32)
    w_exact = np.asarray(jnp.asarray(w, dtype).astype(jnp.float32), np.float64)
    want = x.astype(np.float64) @ w_exact
    atol = 1e-6 * (np.abs(x) @ np.abs(w_exact)).max()  # float32 sums' rounding
    run = jax.jit(xla_matmul, static_argnums=(2, 3))
    for got in (run(jnp.asarray(x), jnp.asarray(w, dtype), False, True),
                run(jnp.asarray(x), jnp.asarray(w.T, dtype), True, True)):
        assert got.shape == (70, 96) and got.dtype == np.float32
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=atol)
    rounded = np.asarray(run(jnp.asarray(x), jnp.asarray(w, dtype), False, False), np.float64)
    assert np.abs(rounded - want).max() > 10 * np.abs(np.asarray(run(jnp.asarray(x), jnp.asarray(w, dtype), False,
                                                                       True), np.float64) - want).max()


@pytest.mark.parametrize("m,k,n", [(1, 768, 2048), (1, 1027, 32), (5, 100, 48), (7, 1030, 256), (100, 600, 96)])
def test_int8_matmul_equals_numpy_on_both_paths(m, k, n):
    """int8 weights (their integer values; callers scale the columns) on the kernel and XLA's dot."""
    rng = np.random.default_rng(m * 1000 + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.integers(-127, 128, (k, n)).astype(np.int8)
    packed = pack(jnp.asarray(w), jnp.int8)
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(np.asarray(jax.jit(matmul)(jnp.asarray(x), packed)), want, rtol=1e-4, atol=1e-2)
    x_rounded = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    got = np.asarray(jax.jit(xla_matmul)(jnp.asarray(x), jnp.asarray(w)))  # x in bfloat16, as for bfloat16 weights
    np.testing.assert_allclose(got, x_rounded @ w.astype(np.float64), rtol=1e-4, atol=1e-2)


def test_packed_int8_linears_equal_the_int8_linear_fused_or_not():
    from engine.layers.quantize import Int8Linear

    Pos, Embed = hax.Axis("position", 6), hax.Axis("embed", 40)
    Heads, KV, Dim = hax.Axis("heads", 3), hax.Axis("kv_head", 1), hax.Axis("head_size", 16)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    shapes = [((Heads, Dim), keys[0], False), ((KV, Dim), keys[1], True), ((KV, Dim), keys[2], False)]
    linears = [Int8Linear.from_linear(hnn.Linear.init(In=Embed, Out=Out, key=key, use_bias=bias))
               for Out, key, bias in shapes]
    x = hax.random.normal(keys[3], (Pos, Embed))
    parts = [PackedLinear.from_linear(linear, jnp.float32) for linear in linears]
    assert all(part.weight.dtype == jnp.int8 for part in parts)
    for linear, part, fused in zip(linears, parts, jax.jit(lambda f, x: f(x))(FusedLinear.fuse(parts), x)):
        want = linear(x)
        assert part(x).axes == fused.axes == want.axes
        np.testing.assert_allclose(np.asarray(part(x).array), np.asarray(want.array), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(fused.array), np.asarray(want.array), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,k,n,group", [(1, 256, 64, 32), (7, 2048, 96, 128), (3, 1100, 32, 1100), (13, 64, 32, 16),
                                         (40, 3072, 48, 128), (100, 2100, 32, 2100)])
@pytest.mark.parametrize("wide", WIDTHS)
def test_float8_matmul_scales_each_group_of_depth_rows_and_column(m, k, n, group, wide):
    """e4m3 weights of every value the format holds (normal and subnormal, both signs), each group of
    `group` depth rows and each column with its own scale: depths past the kernel's depth block
    (1024) with groups that straddle it or not, per-column scales (group = depth), row counts on
    both tiles."""
    import ml_dtypes

    from engine.backends.cpu.kernels import pack_scales

    rng = np.random.default_rng(m * 1000 + k)
    codes = rng.integers(0, 256, (k, n)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    w = codes.view(ml_dtypes.float8_e4m3fn)
    scales = rng.uniform(0.01, 2.0, (k // group, n)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = x.astype(np.float64) @ (w.astype(np.float64) * np.repeat(scales, group, axis=0))
    got = jax.jit(matmul, static_argnames="wide")(jnp.asarray(x), pack(jnp.asarray(w), w.dtype), wide=wide,
                                                  scales=pack_scales(jnp.asarray(scales)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-3 * np.abs(want).max())


def test_a_stacked_float8_weight_is_read_with_its_layers_scales():
    """The kernel reads layer 1 of a stack of float8 panels and scales in place (a scanned layer loop)."""
    import ml_dtypes

    from engine.backends.cpu.kernels import pack_scales

    rng = np.random.default_rng(3)
    w = rng.standard_normal((2, 256, 32)).astype(ml_dtypes.float8_e4m3fn)
    scales = rng.uniform(0.5, 2.0, (2, 2, 32)).astype(np.float32)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    got = jax.jit(matmul)(jnp.asarray(x), pack(jnp.asarray(w), w.dtype), jnp.int32(1), scales=pack_scales(scales))
    want = x @ (w[1].astype(np.float32) * np.repeat(scales[1], 128, axis=0))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_packed_fp8_linears_equal_the_fp8_linear_fused_or_not():
    """Fp8Linears of a checkpoint's blocks (8 x 16 over q heads of 16, 2 KV heads of 16 each) packed,
    alone and fused as q/k/v are: the same outputs as the Fp8Linear's own product."""
    from engine.layers.fp8 import Fp8Linear, from_checkpoint, scale_axes
    from tests.support.fp8_checkpoints import quantized

    Pos, Embed = hax.Axis("position", 6), hax.Axis("embed", 48)
    Heads, KV, Dim = hax.Axis("heads", 3), hax.Axis("kv_head", 2), hax.Axis("head_size", 16)
    rng = np.random.default_rng(4)
    linears = []
    for Out in ((Heads, Dim), (KV, Dim), (KV, Dim)):
        q, s = quantized(rng.standard_normal((hax.axis_size(Out), 48)).astype(np.float32), (8, 16))
        scaled = ((*scale_axes((Embed,), 16),), scale_axes(Out, 8))
        weight, scale = from_checkpoint(jnp.asarray(q), jnp.asarray(s), (), (Embed,), Out, scaled, (8, 16))
        linears.append(Fp8Linear(weight, scale, None, (Embed,), Out, (8, 16), "weight_scale_inv"))
    x = hax.random.normal(jax.random.PRNGKey(5), (Pos, Embed))
    parts = [PackedLinear.from_linear(linear, jnp.float32) for linear in linears]
    assert all(part.weight.dtype == jnp.float8_e4m3fn and part.plain is None for part in parts)
    for linear, part, fused in zip(linears, parts, jax.jit(lambda f, x: f(x))(FusedLinear.fuse(parts), x)):
        want = linear(x)
        assert part(x).axes == fused.axes == want.axes
        np.testing.assert_allclose(np.asarray(part(x).array), np.asarray(want.array), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(fused.array), np.asarray(want.array), rtol=1e-5, atol=1e-5)


def test_pack_rejects_widths_off_the_panel():
    with pytest.raises(ValueError, match="multiple of 16"):
        pack(jnp.zeros((8, 20)), jnp.float32)


def test_packed_linear_equals_haliax_linear_with_multi_axis_in_and_out():
    Pos, Heads, HeadSize = hax.Axis("position", 5), hax.Axis("heads", 3), hax.Axis("head_size", 8)
    KV, Group = hax.Axis("kv_head", 2), hax.Axis("q_heads_per_group", 16)
    linear = hnn.Linear.init(In=(Heads, HeadSize), Out=(KV, Group), key=jax.random.PRNGKey(0), use_bias=True)
    linear = hnn.Linear(linear.weight, hax.random.normal(jax.random.PRNGKey(1), (KV, Group)), linear.In, linear.Out)
    x = hax.random.normal(jax.random.PRNGKey(2), (Pos, Heads, HeadSize))
    want = linear(x)
    got = PackedLinear.from_linear(linear, jnp.float32)(x)
    assert got.axes == want.axes
    np.testing.assert_allclose(np.asarray(got.array), np.asarray(want.array), rtol=1e-5, atol=1e-5)


def test_xla_path_reads_the_plain_matrix_and_keeps_only_it():
    """With every row count on XLA's dot, a module holds no panels and computes what the kernel
    does: multi-axis inputs and outputs, fused int8 parts, a tied LM head over the embedding table
    (its plain matrix is the table itself, no copy)."""
    from engine.backends.cpu.kernels import keep_read_layouts
    from engine.layers.quantize import Int8Linear

    def on_xla(module, rows):
        xla = keep_read_layouts(module, frozenset({rows}), [rows])
        assert xla.weight is None and xla.plain is not None
        return xla

    Pos, Heads, HeadSize = hax.Axis("position", 5), hax.Axis("heads", 3), hax.Axis("head_size", 8)
    KV, Group = hax.Axis("kv_head", 2), hax.Axis("q_heads_per_group", 16)
    linear = hnn.Linear.init(In=(Heads, HeadSize), Out=(KV, Group), key=jax.random.PRNGKey(0), use_bias=True)
    x = hax.random.normal(jax.random.PRNGKey(2), (Pos, Heads, HeadSize))
    packed = PackedLinear.from_linear(linear, jnp.float32)
    np.testing.assert_allclose(np.asarray(on_xla(packed, 5)(x).array), np.asarray(packed(x).array), rtol=1e-5,
                               atol=1e-5)

    Embed, Vocab = hax.Axis("embed", 40), hax.Axis("vocab", 64)
    parts = [PackedLinear.from_linear(Int8Linear.from_linear(hnn.Linear.init(In=Embed, Out=Out, key=key)),
                                      jnp.float32)
             for Out, key in ((Group, jax.random.PRNGKey(3)), (Vocab, jax.random.PRNGKey(4)))]
    fused, h = FusedLinear.fuse(parts), hax.random.normal(jax.random.PRNGKey(5), (Pos, Embed))
    for got, want in zip(on_xla(fused, 5)(h), fused(h)):
        np.testing.assert_allclose(np.asarray(got.array), np.asarray(want.array), rtol=1e-2, atol=1e-2)

    table = hax.random.normal(jax.random.PRNGKey(6), (Vocab, Embed)).astype(jnp.bfloat16)
    head = PackedLinear.from_weight(table, Embed, Vocab, None, jnp.bfloat16)
    assert head.plain_out_first and head.plain.array is table.array
    np.testing.assert_allclose(np.asarray(on_xla(head, 5)(h).array), np.asarray(head(h).array), rtol=2e-2, atol=5e-2)


def test_fused_linear_returns_each_parts_output():
    """q/k/v-like parts of different widths and output axes, one with a bias, one matmul."""
    Pos, Embed = hax.Axis("position", 7), hax.Axis("embed", 40)
    Heads, KV, Dim = hax.Axis("heads", 3), hax.Axis("kv_head", 1), hax.Axis("head_size", 16)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    linears = [hnn.Linear.init(In=Embed, Out=(Heads, Dim), key=keys[0], use_bias=False),
               hnn.Linear.init(In=Embed, Out=(KV, Dim), key=keys[1], use_bias=True),
               hnn.Linear.init(In=Embed, Out=(KV, Dim), key=keys[2], use_bias=False)]
    k = linears[1]
    linears[1] = hnn.Linear(k.weight, hax.random.normal(jax.random.PRNGKey(5), (KV, Dim)), k.In, k.Out)
    parts = [PackedLinear.from_linear(linear, jnp.bfloat16) for linear in linears]
    fused = FusedLinear.fuse(parts)
    x = hax.random.normal(keys[3], (Pos, Embed))
    got = jax.jit(lambda f, x: f(x))(fused, x)
    assert len(got) == 3
    for out, part in zip(got, parts):
        want = part(x)
        assert out.axes == want.axes
        np.testing.assert_array_equal(np.asarray(out.array), np.asarray(want.array))


def test_fused_linear_rejects_parts_with_different_inputs():
    A, B, Out = hax.Axis("a", 8), hax.Axis("b", 8), hax.Axis("out", 16)
    parts = [PackedLinear.from_linear(hnn.Linear.init(In=In, Out=Out, key=jax.random.PRNGKey(0)), jnp.float32)
             for In in (A, B)]
    with pytest.raises(ValueError, match="share input axes"):
        FusedLinear.fuse(parts)


@pytest.mark.parametrize("shape", [(1, 2048), (3, 13), (64, 8200), (5, 3000), (0, 16)])
def test_silu_mul_equals_silu_times_up(shape):
    """gate and up side by side in each row, as the fused gate/up matmul writes them. Vector body and
    scalar tail, chunks that start and end mid-row and span rows, no rows; gates far out in both
    tails (where e^-g overflows a naive sigmoid) and around zero."""
    rng = np.random.default_rng(sum(shape))
    g = (rng.standard_normal(shape) * 8).astype(np.float32)
    g.flat[:4] = [-200.0, -88.0, 0.0, 200.0][: g.size]
    u = rng.standard_normal(shape).astype(np.float32)
    got = np.asarray(jax.jit(silu_mul)(jnp.asarray(np.concatenate([g, u], axis=1))))
    g64 = g.astype(np.float64)
    want = g64 / (1.0 + np.exp(-g64)) * u
    assert got.shape == shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("rows,vocab", [(1, 32000), (5, 13), (32, 8200), (3, 8), (0, 16)])
def test_argmax_is_the_first_maximum(rows, vocab):
    """Vector body and scalar tail; ties (the first wins, as jnp.argmax), a maximum in the tail,
    -inf rows (every token biased out), no rows."""
    rng = np.random.default_rng(rows * vocab)
    x = rng.standard_normal((rows, vocab)).astype(np.float32)
    if rows >= 3:
        x[0, [vocab // 3, vocab - 1]] = 50.0  # a tie: the first index wins
        x[1, vocab - 1] = 60.0  # the maximum in the last (possibly scalar-tail) element
        x[2] = -np.inf
    got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
    assert got.dtype == np.int32 and got.shape == (rows,)
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


@pytest.mark.parametrize("sizes", [(1, 0, 1, 0, 0, 1), (0, 3, 0, 0, 5, 0), (20, 0, 1, 0, 30, 2), (0,) * 6])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("wide", WIDTHS)
def test_grouped_matmul_multiplies_each_group_by_its_own_expert(sizes, dtype, wide):
    """A mixture of experts' grouped product: rows grouped by expert (decode-sized groups sharing
    one pass, groups past 16 rows one after another, empty groups, no rows at all), each group
    times its own expert's weight read from the stack; the rows after the last group are zeros."""
    rng = np.random.default_rng(sum(sizes))
    experts, k, n = len(sizes), 64, 48
    w = np.asarray(jnp.asarray(rng.standard_normal((experts, k, n)), dtype).astype(jnp.float32))
    x = rng.standard_normal((sum(sizes) + 3, k)).astype(np.float32)
    got = np.asarray(jax.jit(grouped_matmul, static_argnames="wide")(
        jnp.asarray(x), pack(jnp.asarray(w), dtype), jnp.asarray(sizes, jnp.int32), wide=wide))
    expert = np.repeat(np.arange(experts), sizes)
    want = np.einsum("rk,rkn->rn", x[:len(expert)].astype(np.float64), w[expert].astype(np.float64))
    assert got.shape == (len(x), n)
    np.testing.assert_allclose(got[:len(expert)], want, rtol=1e-5, atol=1e-4)
    assert not got[len(expert):].any(), "rows in no group get zeros"


def _reference_attention(q, k_all, v_all, layer, pages, rows, lens, window=0, softcap=None, sinks=None):
    """Each query s against the first lens[s] tokens of page table rows[s] (the last `window` of
    them with a window), scores soft-capped with `softcap`, with sinks[h, g] in head (h, g)'s
    softmax denominator (gpt-oss's: exp(sink - m) with m the larger of the sink and the scores'
    maximum), in float64."""
    s, h, g, d = q.shape
    page_size = k_all.shape[-1]
    out = np.zeros_like(q)
    for query in range(s):
        if lens[query] == 0 or rows[query] >= len(pages):
            continue
        n, table = lens[query], pages[rows[query]]
        seen = range(max(0, n - window) if window else 0, n)
        slots = [(table[t // page_size], t % page_size) for t in seen]
        keys = np.stack([k_all[layer, p, :, :, slot] for p, slot in slots], axis=-1)  # [h, d, n]
        values = np.stack([v_all[layer, p, :, slot] for p, slot in slots], axis=1)  # [h, n, d]
        scores = np.einsum("hgd,hdn->hgn", q[query].astype(np.float64), keys)
        if softcap:
            scores = softcap * np.tanh(scores / softcap)
        top = scores.max(-1, keepdims=True) if sinks is None else np.maximum(scores.max(-1, keepdims=True),
                                                                            sinks[..., None])
        weights = np.exp(scores - top)
        sink = 0.0 if sinks is None else np.exp(sinks[..., None] - top)
        weights /= weights.sum(-1, keepdims=True) + sink
        out[query] = np.einsum("hgn,hnd->hgd", weights, values)
    return out


WIDTHS = [pytest.param(False, id="8-lane"),
          pytest.param(True, id="16-lane", marks=pytest.mark.skipif(
              not cpu_kernels.wide_vectors(), reason="needs AVX-512"))]


@pytest.fixture(params=WIDTHS)
def vector_width(request):
    """The attention kernel on 8-lane (AVX2) and, where the CPU has AVX-512, 16-lane vectors."""
    return request.param


@pytest.mark.parametrize(("page_size", "group", "dim"), [(4, 3, 8), (16, 3, 16), (16, 1, 64), (8, 5, 32), (24, 4, 64),
                                                         (16, 4, 128), (16, 5, 48), (16, 2, 80)])
@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16, jnp.uint16])
def test_paged_attention_equals_dense_reference(page_size, group, dim, cache_dtype, vector_width):
    """Scalar paths (page size 4, head dim 8: no 8-token or 16-column blocks) and vector paths (one or
    two 8-token blocks per page, query-head blocks of 1, 4 and 4 + 1; on 16 lanes, pages of 16 in
    pairs and value columns in blocks of 64, 48 and 64 + 16), over a float32 or bfloat16 cache, or
    bfloat16 stored as its uint16 bits (the reference gets the bfloat16 values widened). Queries
    share page tables the way a prompt's tokens do; a row outside the tables reads nothing."""
    rng = np.random.default_rng(page_size * group)
    layers, num_pages, heads, table_len = 3, 40, 2, 6
    k_all = rng.standard_normal((layers, num_pages, heads, dim, page_size)).astype(np.float32)
    v_all = rng.standard_normal((layers, num_pages, heads, page_size, dim)).astype(np.float32)
    if cache_dtype != jnp.float32:
        k_all, v_all = (np.asarray(jnp.asarray(c).astype(jnp.bfloat16)) for c in (k_all, v_all))
    cache = lambda c: jax.lax.bitcast_convert_type(c, jnp.uint16) if cache_dtype == jnp.uint16 else c  # noqa: E731
    lens = np.array([1, page_size, page_size + 1, 0, table_len * page_size, 2 * page_size - 1, 3], np.int32)
    rows = np.array([0, 1, 1, 2, 3, 4, 5], np.int32)
    pages = rng.permutation(np.arange(1, num_pages))[: 5 * table_len].reshape(5, table_len).astype(np.int32)
    q = rng.standard_normal((len(lens), heads, group, dim)).astype(np.float32) * 0.5
    k_cache, v_cache = (cache(jnp.asarray(c)) for c in (k_all, v_all))
    got = np.asarray(jax.jit(paged_attention, static_argnames="wide")(
        jnp.asarray(q), k_cache, v_cache, 2, jnp.asarray(pages), jnp.asarray(rows), jnp.asarray(lens), wide=vector_width))
    want = _reference_attention(q, k_all.astype(np.float32), v_all.astype(np.float32), 2, pages, rows, lens)
    np.testing.assert_allclose(got[:6], want[:6], rtol=1e-5, atol=1e-5)
    assert not got[3].any(), "padding (lens 0) gets zeros"
    assert not got[6].any(), "a row outside the page tables reads nothing"


@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_attention_with_a_sliding_window_and_a_soft_cap(page_size, vector_width):
    """Gemma's and Mistral's attention: each query sees only the last `window` of its tokens, and
    scores are soft-capped (cap * tanh(s / cap)) before the softmax; a window wider than a row sees it all."""
    rng = np.random.default_rng(11)
    layers, num_pages, heads, group, dim, table_len = 2, 40, 2, 3, 64, 6
    k_all = rng.standard_normal((layers, num_pages, heads, dim, page_size)).astype(np.float32)
    v_all = rng.standard_normal((layers, num_pages, heads, page_size, dim)).astype(np.float32)
    pages = rng.permutation(np.arange(1, num_pages))[: 3 * table_len].reshape(3, table_len).astype(np.int32)
    lens = np.array([1, 5, page_size + 3, 3 * page_size + 1, table_len * page_size], np.int32)
    rows = np.array([0, 1, 1, 2, 2], np.int32)
    q = rng.standard_normal((len(lens), heads, group, dim)).astype(np.float32) * 2.0
    for window, softcap in ((7, None), (0, 5.0), (page_size + 2, 5.0), (10**6, None)):
        got = np.asarray(jax.jit(paged_attention, static_argnums=(7, 8), static_argnames="wide")(
            jnp.asarray(q), jnp.asarray(k_all), jnp.asarray(v_all), 1, jnp.asarray(pages), jnp.asarray(rows),
            jnp.asarray(lens), window, softcap, wide=vector_width))
        want = _reference_attention(q, k_all, v_all, 1, pages, rows, lens, window, softcap)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"window {window}, softcap {softcap}")


@pytest.mark.parametrize(("group", "dim", "window"), [(1, 64, 0), (3, 64, 0), (3, 64, 9), (5, 32, 0), (13, 16, 0)])
def test_a_prompts_queries_attend_together_exactly_as_each_alone(group, dim, window, vector_width):
    """Consecutive prompt tokens of one row (visible lengths n, n + 1, ...) share each key and
    value load on 16 lanes, up to 12 query vectors at once (runs of 12, 4, 2 and 1 queries for
    groups 1, 3, 5 and 13; 13 heads split 12 + 1). Each output is bit for bit the one its query
    gets alone: batch invariance does not depend on where a step cuts a prompt. The runs here
    break where the row or the length sequence does, and at padding."""
    rng = np.random.default_rng(group * dim + window)
    layers, num_pages, heads, page_size, table_len = 1, 30, 2, 16, 8
    k_all = jnp.asarray(rng.standard_normal((layers, num_pages, heads, dim, page_size)), jnp.bfloat16)
    v_all = jnp.asarray(rng.standard_normal((layers, num_pages, heads, page_size, dim)), jnp.bfloat16)
    pages = rng.permutation(np.arange(1, num_pages))[: 3 * table_len].reshape(3, table_len).astype(np.int32)
    lens = np.array([*range(1, 38), 0, 0, *range(90, 97), 5, *range(20, 26), 27], np.int32)
    rows = np.array([0] * 37 + [3, 3] + [1] * 7 + [2] * 8, np.int32)
    q = jnp.asarray(rng.standard_normal((len(lens), heads, group, dim)) * 0.5, jnp.float32)
    attend = jax.jit(paged_attention, static_argnums=7, static_argnames="wide")
    together = np.asarray(attend(q, k_all, v_all, 0, pages, rows, lens, window, wide=vector_width))
    alone = np.concatenate([np.asarray(attend(q[s:s + 1], k_all, v_all, 0, pages, rows[s:s + 1], lens[s:s + 1],
                                              window, wide=vector_width)) for s in range(len(lens))])
    np.testing.assert_array_equal(together, alone)
    want = _reference_attention(np.asarray(q), np.asarray(k_all, np.float32), np.asarray(v_all, np.float32), 0,
                                pages, rows, lens, window)
    np.testing.assert_allclose(together, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("page_size", "group", "dim"), [(4, 3, 8), (16, 3, 16), (16, 1, 64), (16, 5, 48), (8, 8, 64)])
def test_paged_attention_with_sinks(page_size, group, dim, vector_width):
    """gpt-oss's attention sinks: each query head's learned logit joins its softmax's denominator
    (no value), over whole rows, a sliding window and soft-capped scores; sinks far above the
    scores (the output shrinks towards zero) and far below (no change). A prompt's queries attend
    together exactly as each alone, and padding still gets zeros."""
    rng = np.random.default_rng(page_size * group + dim)
    layers, num_pages, heads, table_len = 2, 40, 2, 6
    k_all = rng.standard_normal((layers, num_pages, heads, dim, page_size)).astype(np.float32)
    v_all = rng.standard_normal((layers, num_pages, heads, page_size, dim)).astype(np.float32)
    pages = rng.permutation(np.arange(1, num_pages))[: 3 * table_len].reshape(3, table_len).astype(np.int32)
    lens = np.array([1, *range(page_size - 2, page_size + 3), 0, 3 * page_size + 1, table_len * page_size], np.int32)
    rows = np.array([0, 1, 1, 1, 1, 1, 2, 2, 2], np.int32)
    q = rng.standard_normal((len(lens), heads, group, dim)).astype(np.float32)
    sinks = (rng.standard_normal((heads, group)) * 2.0).astype(np.float32)
    sinks[0, 0], sinks[-1, -1] = 30.0, -1e4
    attend = jax.jit(paged_attention, static_argnums=(7, 8), static_argnames="wide")
    for window, softcap in ((0, None), (7, None), (page_size + 2, 3.0)):
        args = (jnp.asarray(k_all), jnp.asarray(v_all), 1, jnp.asarray(pages))
        got = np.asarray(attend(jnp.asarray(q), *args, jnp.asarray(rows), jnp.asarray(lens), window, softcap,
                                jnp.asarray(sinks), wide=vector_width))
        want = _reference_attention(q, k_all, v_all, 1, pages, rows, lens, window, softcap, sinks)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"window {window}, softcap {softcap}")
        alone = np.concatenate([np.asarray(attend(jnp.asarray(q[s:s + 1]), *args, jnp.asarray(rows[s:s + 1]),
                                                  jnp.asarray(lens[s:s + 1]), window, softcap, jnp.asarray(sinks),
                                                  wide=vector_width)) for s in range(len(lens))])
        np.testing.assert_array_equal(got, alone)
        assert not got[6].any(), "padding (lens 0) gets zeros"
    plain = np.asarray(attend(jnp.asarray(q), *args, jnp.asarray(rows), jnp.asarray(lens), 0, None, wide=vector_width))
    assert np.abs(got[:, 0, 0]).max() < 1e-6 < np.abs(plain[:, 0, 0]).max(), "a sink of 30 takes all the weight"


@pytest.mark.parametrize(("page_size", "group", "dim"), [(4, 3, 12), (16, 4, 72), (16, 13, 576), (8, 2, 32)])
@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.uint16])
def test_a_cache_whose_values_are_its_keys_is_read_from_one_array(page_size, group, dim, cache_dtype, vector_width):
    """Latent attention's cache (k_all None): one array in the values' layout [layer, page, head,
    slot, dim], each token's key and its value. Scalar (dim 12) and 8-lane dot products, 16-token
    pages in pairs and alone, DeepSeek-V3's 576-wide latent with 13 heads per query; prompt runs
    attend exactly as each query alone."""
    rng = np.random.default_rng(page_size * group + dim)
    layers, num_pages, heads, table_len = 2, 30, 1, 5
    v_all = rng.standard_normal((layers, num_pages, heads, page_size, dim)).astype(np.float32)
    if cache_dtype == jnp.uint16:
        v_all = np.asarray(jnp.asarray(v_all).astype(jnp.bfloat16)).astype(np.float32)
    stored = jnp.asarray(v_all) if cache_dtype == jnp.float32 else jax.lax.bitcast_convert_type(
        jnp.asarray(v_all, jnp.bfloat16), jnp.uint16)
    pages = rng.permutation(np.arange(1, num_pages))[: 3 * table_len].reshape(3, table_len).astype(np.int32)
    lens = np.array([1, *range(page_size - 1, page_size + 2), 0, 2 * page_size + 3, table_len * page_size], np.int32)
    rows = np.array([0, 1, 1, 1, 2, 2, 2], np.int32)
    q = (rng.standard_normal((len(lens), heads, group, dim)) * dim ** -0.5).astype(np.float32)
    attend = jax.jit(paged_attention, static_argnames="wide")
    got = np.asarray(attend(jnp.asarray(q), None, stored, 1, jnp.asarray(pages), jnp.asarray(rows),
                            jnp.asarray(lens), wide=vector_width))
    keys = v_all.transpose(0, 1, 2, 4, 3)  # [layer, page, head, dim, slot]: the keys' own layout
    want = _reference_attention(q, keys, v_all, 1, pages, rows, lens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    alone = np.concatenate([np.asarray(attend(jnp.asarray(q[s:s + 1]), None, stored, 1, jnp.asarray(pages),
                                              jnp.asarray(rows[s:s + 1]), jnp.asarray(lens[s:s + 1]),
                                              wide=vector_width)) for s in range(len(lens))])
    np.testing.assert_array_equal(got, alone)
    assert not got[4].any(), "padding (lens 0) gets zeros"


def test_paged_attention_refuses_sinks_of_another_shape():
    q = jnp.zeros((1, 2, 3, 16), jnp.float32)
    kv = jnp.zeros((1, 2, 2, 16, 16), jnp.float32)
    with pytest.raises(Exception, match=r"want sinks\[H,G\]"):
        paged_attention(q, kv, kv, 0, jnp.zeros((1, 1), jnp.int32), jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32),
                        sinks=jnp.zeros((2, 2), jnp.float32)).block_until_ready()


def test_the_kernel_and_the_xla_backend_attend_a_packed_step_alike():
    """A packed step: a decode row, a 4-token chunk continuing a cached prefix, a fresh 2-token
    prompt, then padding tokens (belonging to a padding row). Every real token attends causally to
    its own sequence; both backends match the reference."""
    from engine.backends.base import visible_tokens
    from engine.backends.xla import SplitKVCache, _paged_attention
    from engine.step.plan import StepInputs

    rng = np.random.default_rng(7)
    layers, num_pages, heads, group, dim, page_size, table_len, tokens = 2, 30, 2, 3, 16, 4, 40, 10
    k_all = rng.standard_normal((layers, num_pages, heads, dim, page_size)).astype(np.float32)
    v_all = rng.standard_normal((layers, num_pages, heads, page_size, dim)).astype(np.float32)
    pages = np.zeros((4, table_len), np.int32)
    pages[:3, :4] = rng.permutation(np.arange(1, num_pages))[:12].reshape(3, 4)
    positions = np.array([8, 6, 7, 8, 9, 0, 1, 0, 0, 0], np.int32)
    token_row = np.array([0, 1, 1, 1, 1, 2, 2, 3, 3, 3], np.int32)
    zeros = np.zeros(tokens, np.int32)
    inputs = StepInputs(zeros, positions, zeros, zeros - 1, token_row, pages,
                        kv_lens=np.array([9, 10, 2, 0], np.int32), q_start=np.array([0, 1, 5, 7], np.int32),
                        q_lens=np.array([1, 4, 2, 0], np.int32), sample_index=np.zeros(4, np.int32),
                        adapter=np.full(4, -1, np.int32), long_rope=np.zeros(4, np.bool_))
    inputs = StepInputs(*map(jnp.asarray, inputs))
    q = rng.standard_normal((tokens, heads, group, dim)).astype(np.float32) * 0.5
    lens = np.asarray(visible_tokens(inputs))
    assert lens.tolist() == [9, 7, 8, 9, 10, 1, 2, 0, 0, 0]
    want = _reference_attention(q, k_all, v_all, 1, pages, token_row, lens)
    k_all, v_all, q = map(jnp.asarray, (k_all, v_all, q))
    kernel = np.asarray(jax.jit(paged_attention)(q, k_all, v_all, 1, inputs.page_table, inputs.token_row, lens))
    xla = np.asarray(jax.jit(_paged_attention, static_argnums=2)(q, SplitKVCache(k_all, v_all), 1,
                                                                   inputs.page_table[inputs.token_row], lens))
    np.testing.assert_allclose(kernel[:7], want[:7], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(xla[:7], want[:7], rtol=1e-5, atol=1e-5)
    assert not kernel[7:].any()


def test_the_attention_benchmarks_pytorch_reference_computes_what_the_kernel_does():
    """`attention_bench.py --reference` times PyTorch's attention over the same prompt: its keys and
    values gathered out of the shuffled pages, one copy per query head, the queries unscaled."""
    from benchmarks.attention_bench import inputs, torch_attention

    q, k, v, pages, rows, lens = inputs(tokens=45, kv_heads=2, group=3, dim=32, page_size=16, seed=3)
    kernel = np.asarray(jax.jit(paged_attention)(q, k, v, 0, pages, rows, lens))
    reference = torch_attention(q, k, v, pages)().numpy()[0]  # [query head, token, dim]
    np.testing.assert_allclose(kernel, reference.transpose(1, 0, 2).reshape(kernel.shape), rtol=1e-5, atol=1e-5)


def test_a_failing_build_falls_back_with_a_warning(tmp_path):
    """No working compiler: available() is False and the warning says why (the engine then uses
    XLA's ops)."""
    import os
    import subprocess
    import sys

    code = "import logging; logging.basicConfig(); from engine.backends.cpu import kernels as cpu_kernels; print(cpu_kernels.available())"
    env = {**os.environ, "CXX": "false", "JAX_SERVE_CACHE": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False"
    assert "CPU kernels unavailable" in proc.stderr and "false failed to build kernels.cc" in proc.stderr
