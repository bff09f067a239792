"""The engine's CPU kernels (engine/backends/cpu/kernels.cc): build, load and call them from JAX.

- `matmul` / `PackedLinear`: XLA's CPU dot is slow on the few-row products of decoding and has no
  fast bfloat16 path; this kernel streams packed weights (float32, bfloat16, or int8 with a scale
  per output column) and accumulates in float32, on 16-lane vectors for many-row products where
  the CPU has AVX-512. Many-row products may run on XLA's dot instead, over the plain matrix
  (`xla_matmul`).
- `grouped_matmul`: a mixture of experts' products, rows grouped by expert, each group against its
  own expert's packed weight read in place (XLA on CPUs runs a grouped product over every expert).
- `paged_attention`: each query token against its sequence's pages, read in place from the KV pool
  (XLA would gather every row's pages into a padded copy first). A prompt token is a query with its
  own visible length, so the same kernel runs causal prefill attention; a prompt's consecutive
  tokens are attended together, each key and value load feeding all of them. Sliding windows,
  soft-capped scores and attention sinks (a logit per query head in the softmax's denominator) are
  the kernel's own. On 16-lane vectors where the CPU has AVX-512 (`wide_vectors`), else on 8-lane
  AVX2 ones.
- `silu_mul`: SwiGLU's silu(gate) * up on every thread, straight from the fused gate/up output (XLA
  runs this elementwise fusion on one thread, after copying gate and up out of it).
- `argmax`: greedy decoding's row-wise argmax over the vocabulary (XLA's reduction is one-threaded
  and scalar).

They are compiled once per source and jaxlib version with the system C++ compiler into `$JAX_SERVE_CACHE/kernels`
(default `~/.cache/jax-serve/kernels`) and registered as an XLA FFI target. `available()` is False
(and callers keep XLA's dot) off CPU, without AVX2/FMA/F16C, or when no compiler works.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray

from engine.layers.fp8 import Fp8Linear
from engine.layers.quantize import Int8Linear

logger = logging.getLogger(__name__)

PANEL = 16
"""Output columns per packed panel; a packable weight has N % PANEL == 0."""
_SOURCE = Path(__file__).with_name("kernels.cc")
_SYMBOLS = {"jax_serve_matmul": "JaxServeMatmul", "jax_serve_grouped_matmul": "JaxServeGroupedMatmul",
            "jax_serve_paged_attention": "JaxServePagedAttention",
            "jax_serve_silu_mul": "JaxServeSiluMul", "jax_serve_argmax": "JaxServeArgmax"}


def available() -> bool:
    """True when the kernels can run here: a CPU backend on an AVX2 + FMA + F16C machine, built and loaded."""
    return jax.default_backend() == "cpu" and _cpu_has_avx2_fma_f16c() and _load()


def pack(w: jax.Array, dtype) -> jax.Array:
    """W[..., K, N] (inputs first) -> dtype[..., N / 16, K, 16], the kernel's panel layout."""
    *lead, k, n = w.shape
    if n % PANEL:
        raise ValueError(f"pack: output dimension {n} is not a multiple of {PANEL}")
    return jnp.swapaxes(w.astype(dtype).reshape(*lead, k, n // PANEL, PANEL), -3, -2)


def matmul(x: jax.Array, packed: jax.Array, layer=None, wide: bool | None = None,
           scales: jax.Array | None = None) -> jax.Array:
    """f32[M, K] @ packed[N / 16, K, 16] -> f32[M, N]; packed is float32, bfloat16, int8 (its
    integer values, unscaled) or float8 e4m3 with `scales` f32[N / 16, K / G, 16] (`pack_scales`:
    each group of G depth rows and column its own). With `layer` (an i32 scalar), packed (and
    scales) is a stack [layers, ...] read in place at that layer. `wide`: products of more than 16
    rows on 16-lane vectors (None: `wide_vectors()`); the same sums in the same order, so the same
    outputs, as the 8-lane path."""
    m, n = x.shape[0], packed.shape[-3] * PANEL
    group = 0 if scales is None else x.shape[1] // scales.shape[-2]
    call = jax.ffi.ffi_call("jax_serve_matmul", jax.ShapeDtypeStruct((m, n), jnp.float32))
    return call(x.astype(jnp.float32), packed, jnp.asarray(0 if layer is None else layer, jnp.int32),
                jnp.zeros((0,), jnp.float32) if scales is None else scales,
                wide=wide_vectors() if wide is None else bool(wide), group=np.int64(group))


def grouped_matmul(x: jax.Array, packed: jax.Array, group_sizes: jax.Array, wide: bool | None = None) -> jax.Array:
    """A mixture of experts' grouped product: x f32[R, K] holds rows grouped by expert in expert order
    (group_sizes i32[E] rows each), packed [E, N / 16, K, 16] every expert's panels (float32 or
    bfloat16); returns f32[R, N], each row times its own expert's weight, zeros for the rows after
    the last group. Each expert's panels are read in place, once for all its rows."""
    call = jax.ffi.ffi_call("jax_serve_grouped_matmul",
                            jax.ShapeDtypeStruct((x.shape[0], packed.shape[-3] * PANEL), jnp.float32))
    return call(x.astype(jnp.float32), packed, group_sizes.astype(jnp.int32),
                wide=wide_vectors() if wide is None else bool(wide))


def pack_scales(scales: jax.Array) -> jax.Array:
    """f32[..., K / G, N] FP8 scales (each group of G depth rows and column its own) -> f32[...,
    N / 16, K / G, 16] in the weights' panels, times 256 (the kernel widens e4m3 to 1/256 its value)."""
    return pack(scales.astype(jnp.float32) * 256.0, jnp.float32)


def xla_matmul(x: jax.Array, w: jax.Array, out_first: bool = False, f32: bool = False) -> jax.Array:
    """f32[M, K] @ w[K, N] (w[N, K] when `out_first`) on XLA's dot, which reads either layout as it
    is: x in w's dtype (int8 weights widened to bfloat16, exact), float32 sums. With `f32`, w is
    widened to float32 (exact) and x stays float32: the kernel's arithmetic on XLA's float32 dot."""
    if f32 or w.dtype == jnp.int8:
        w = w.astype(jnp.float32 if f32 else jnp.bfloat16)
    dims = (((1,), (1 if out_first else 0,)), ((), ()))
    return jax.lax.dot_general(x.astype(w.dtype), w, dims, preferred_element_type=jnp.float32)


class PackedLinear(eqx.Module):
    """A drop-in for haliax's `Linear` on the CPU: same axes, same math, float32 output (inputs are
    cast to float32). Each product runs on the kernel, over `weight` in its panel layout, or on
    XLA's dot (the row counts in `xla_rows`, those in `f32_rows` widened to float32;
    engine.backends.cpu.matmul_choice), over `plain`, the
    same weight as a [K, N] matrix: XLA's CPU dot (oneDNN) is fast on that, and reading the panels
    cost it a transpose of the whole weight per product. A module keeps only the layouts its
    products read (`keep_read_layouts`): both only where the two paths split the row counts.

    A scanned layer loop reads a stacked packed weight in place: `at_layer(i)` keeps the whole
    stack (layers, panel, in, lane) and the layer index, which the kernel reads from, instead of a
    sliced copy of the layer's weight (XLA's dot gets the layer's slice of `plain`)."""

    weight: NamedArray | None  # dtype[..., panel = N / 16, in = K, lane = 16], N = prod(Out), K = prod(In)
    plain: NamedArray | None
    """The weight as (..., *In, *Out), or (..., Out, In) with `plain_out_first` (a tied LM head
    reads the embedding table)."""
    bias: NamedArray | None
    scale: NamedArray | None
    """With int8 weights: f32[..., out = N], each output column's scale (engine.layers.quantize)."""
    In: tuple[hax.Axis, ...] = eqx.field(static=True)
    Out: tuple[hax.Axis, ...] = eqx.field(static=True)
    group_scales: NamedArray | None = None
    """With float8 weights (engine.layers.fp8): f32[..., panel, group, lane] (`pack_scales`); such a
    weight runs on the kernel only (no `plain`)."""
    xla_rows: frozenset[int] = eqx.field(static=True, default=frozenset())
    f32_rows: frozenset[int] = eqx.field(static=True, default=frozenset())
    """Of `xla_rows`, those whose product widens the weight to float32 (`xla_matmul(f32=True)`)."""
    plain_out_first: bool = eqx.field(static=True, default=False)
    layer: jax.Array | None = None
    """With a stacked weight: the layer this module computes (an i32 scalar)."""

    @staticmethod
    def packable(linear) -> bool:
        return hax.axis_size(linear.Out) % PANEL == 0

    @staticmethod
    def from_linear(linear, dtype) -> "PackedLinear":
        """A haliax `Linear` packed in `dtype`, an `Int8Linear` packed as int8 with its scales, or an
        `Fp8Linear` packed as float8 with its group scales."""
        if isinstance(linear, Fp8Linear):
            return PackedLinear.from_fp8(linear)
        if isinstance(linear, Int8Linear):
            return PackedLinear.from_weight(linear.weight, linear.In, linear.Out, linear.bias, jnp.int8, linear.scale)
        scale = linear.reparam.active_scale
        weight = linear.weight if isinstance(scale, (int, float)) and scale == 1 else linear.weight * scale
        return PackedLinear.from_weight(weight, linear.In, linear.Out, linear.bias, dtype)

    @staticmethod
    def from_weight(weight: NamedArray, In, Out, bias: NamedArray | None, dtype,
                    scale: NamedArray | None = None) -> "PackedLinear":
        """Both layouts of `weight` (named, any axis order). `plain` is the weight itself wherever
        it is already [..., In, Out] or, with one axis each, [..., Out, In] (an embedding table) in
        `dtype`: no copy."""
        In, Out = hax.axis_spec_to_tuple(In), hax.axis_spec_to_tuple(Out)
        out_first = len(In) == len(Out) == 1 and weight.axes[-2:] == (*Out, *In)
        plain = weight.astype(dtype).rearrange((..., *Out, *In) if out_first else (..., *In, *Out))
        lead = plain.axes[: plain.ndim - len(In) - len(Out)]
        w = plain.rearrange((..., *In, *Out)).array
        w = w.reshape(*(ax.size for ax in lead), hax.axis_size(In), hax.axis_size(Out))
        packed = hax.named(pack(w, dtype), (*lead, "panel", "in", "lane"))
        if scale is not None:
            flat = scale.rearrange((*lead, *Out)).array.astype(jnp.float32)
            scale = hax.named(flat.reshape(*(ax.size for ax in lead), hax.axis_size(Out)), (*lead, "out"))
        return PackedLinear(packed, plain, None if bias is None else bias.astype(jnp.float32), scale, In, Out,
                            plain_out_first=out_first)

    @staticmethod
    def from_fp8(linear: Fp8Linear) -> "PackedLinear":
        """The float8 weight's bytes in panels, its scales per column and group of input rows beside."""
        In, Out = linear.In, linear.Out
        lead = tuple(ax for ax in linear.weight.axes if ax not in In + Out)
        w = linear.weight.rearrange((*lead, *In, *Out)).array
        w = w.reshape(*(ax.size for ax in lead), hax.axis_size(In), hax.axis_size(Out))
        columns = linear.column_scales()
        packed = hax.named(pack(w, w.dtype), (*lead, "panel", "in", "lane"))
        scales = hax.named(pack_scales(columns), (*lead, "panel", "group", "lane"))
        bias = None if linear.bias is None else linear.bias.astype(jnp.float32)
        return PackedLinear(packed, None, bias, None, In, Out, group_scales=scales)

    def at_layer(self, Block: hax.Axis, index) -> "PackedLinear":
        bias = None if self.bias is None else self.bias[Block, index]
        scale = None if self.scale is None else self.scale[Block, index]
        plain = None if self.plain is None else self.plain[Block, index]
        return dataclasses.replace(self, bias=bias, scale=scale, plain=plain, layer=index)

    def __call__(self, inputs: NamedArray, *, key=None) -> NamedArray:
        del key
        batch, y = _product(self, inputs)
        out = unflatten_rows(y, batch, self.Out)
        return out if self.bias is None else out + self.bias


class FusedLinear(eqx.Module):
    """Several `PackedLinear`s over the same input as one product (attention's q/k/v, a SwiGLU
    MLP's gate/up): their panels (and plain matrices) concatenated, so a decode step streams them
    in one pass and wakes the thread pool once. Calling it returns each layer's output, as the
    layers would."""

    weight: NamedArray | None  # dtype[..., panel, in, lane]: the parts' panels, in order
    plain: NamedArray | None
    """(..., *In, "out"): the parts' plain matrices side by side, each output flattened."""
    biases: tuple[NamedArray | None, ...]
    scale: NamedArray | None
    """With int8 weights: the parts' output scales, concatenated (as PackedLinear's)."""
    In: tuple[hax.Axis, ...] = eqx.field(static=True)
    Outs: tuple[tuple[hax.Axis, ...], ...] = eqx.field(static=True)
    group_scales: NamedArray | None = None
    """With float8 weights: the parts' panels of scales, concatenated (as PackedLinear's)."""
    xla_rows: frozenset[int] = eqx.field(static=True, default=frozenset())
    """Row counts whose product runs on XLA's dot (as PackedLinear's)."""
    f32_rows: frozenset[int] = eqx.field(static=True, default=frozenset())
    """Of those, the ones in float32 (as PackedLinear's)."""
    layer: jax.Array | None = None
    """With a stacked weight: the layer this module computes (as PackedLinear's)."""
    plain_out_first = False

    @staticmethod
    def fuse(parts) -> "FusedLinear":
        """Fuse PackedLinears that share their input axes (and weight dtype)."""
        if len({p.In for p in parts}) != 1 or len({p.weight.dtype for p in parts}) != 1:
            raise ValueError("FusedLinear.fuse: the parts must share input axes and weight dtype")
        weight = hax.concatenate("panel", [p.weight for p in parts])
        plain = None if parts[0].plain is None else hax.concatenate(
            "out", [p.plain.rearrange((..., *p.In, *p.Out)).flatten_axes(p.Out, "out") for p in parts])
        scale = None if parts[0].scale is None else hax.concatenate("out", [p.scale for p in parts])
        groups = None if parts[0].group_scales is None else hax.concatenate("panel", [p.group_scales for p in parts])
        return FusedLinear(weight, plain, tuple(p.bias for p in parts), scale, parts[0].In, tuple(p.Out for p in parts),
                           group_scales=groups)

    def at_layer(self, Block: hax.Axis, index) -> "FusedLinear":
        biases = tuple(None if b is None else b[Block, index] for b in self.biases)
        scale = None if self.scale is None else self.scale[Block, index]
        plain = None if self.plain is None else self.plain[Block, index]
        return dataclasses.replace(self, biases=biases, scale=scale, plain=plain, layer=index)

    def __call__(self, inputs: NamedArray, *, key=None) -> tuple[NamedArray, ...]:
        del key
        batch, y = self.concatenated(inputs)
        outs, start = [], 0
        for Out in self.Outs:
            size = hax.axis_size(Out)
            outs.append(unflatten_rows(y[:, start : start + size], batch, Out))
            start += size
        return tuple(outs)

    def concatenated(self, inputs: NamedArray) -> tuple[list[hax.Axis], jax.Array]:
        """inputs' batch axes, and the parts' outputs side by side: f32[prod(batch), sum of sizes]."""
        batch, y = _product(self, inputs)
        if any(bias is not None for bias in self.biases):
            y = y + jnp.concatenate([jnp.zeros(hax.axis_size(Out), jnp.float32) if bias is None
                                     else bias.rearrange(Out).array.reshape(-1)
                                     for Out, bias in zip(self.Outs, self.biases)])
        return batch, y


def keep_read_layouts(module, xla_rows: frozenset[int], rows,
                      f32_rows: frozenset[int] = frozenset()) -> "PackedLinear | FusedLinear":
    """`module` with its products at `xla_rows` on XLA's dot (those at `f32_rows` in float32) and the
    rest of `rows` on the kernel, holding only the layouts those read."""
    kernel_rows = set(rows) - set(xla_rows)
    return dataclasses.replace(module, xla_rows=frozenset(xla_rows), f32_rows=frozenset(f32_rows) & set(xla_rows),
                               weight=module.weight if kernel_rows else None, plain=module.plain if xla_rows else None)


def unflatten_rows(y: jax.Array, batch, Out) -> NamedArray:
    """y f[prod(batch), prod(Out)] as the NamedArray (*batch, *Out): `_product`'s inverse."""
    return hax.named(y.reshape(*(ax.size for ax in batch), *(ax.size for ax in Out)), (*batch, *Out))


def _product(module, inputs: NamedArray) -> tuple[list[hax.Axis], jax.Array]:
    """inputs' axes other than the module's `In` (the batch), and f32[prod(batch), N] = inputs @
    the module's weight times its column scales (int8 weights): on XLA's dot over `plain` when the
    row count is in `xla_rows` (in float32 when in `f32_rows`), else on the kernel over the panels
    (at `layer` of a stack)."""
    In = module.In
    batch = [ax for ax in inputs.axes if ax.name not in {a.name for a in In}]
    x = inputs.rearrange((*batch, *In)).array.reshape(-1, hax.axis_size(In))
    if x.shape[0] in module.xla_rows:
        plain = module.plain.array  # a reshape of its trailing axes: free in a jitted step
        w = plain.reshape(-1, plain.shape[-1]) if module.plain_out_first else plain.reshape(x.shape[1], -1)
        y = xla_matmul(x, w, module.plain_out_first, x.shape[0] in module.f32_rows)
    else:
        scales = None if module.group_scales is None else module.group_scales.array
        y = matmul(x, module.weight.array, module.layer, scales=scales)
    return batch, y if module.scale is None else y * module.scale.array


def paged_attention(q: jax.Array, k_all: jax.Array | None, v_all: jax.Array, layer, pages: jax.Array,
                    rows: jax.Array, lens: jax.Array, window=0, softcap=None, sinks: jax.Array | None = None,
                    wide: bool | None = None) -> jax.Array:
    """Softmax attention of each pre-scaled query over the first `lens` cached tokens of its
    sequence (a query is a decoding sequence's token or one prompt token); with `window` > 0 (an
    i32 scalar, traced or not) over the last `window` of them only; with `softcap`, scores become
    cap * tanh(scores / cap); with `sinks` f32[kv_head, group], query head (h, g) has the logit
    sinks[h, g] in its softmax's denominator (and no value).

    q: f32[S, kv_head, group, head_dim]; k_all: [layer, page, kv_head, head_dim, slot], or None
    where the values are the keys (latent attention: the keys are read from v_all's rows); v_all:
    [layer, page, kv_head, slot, head_dim], both float32 or both bfloat16 (or bfloat16's uint16 bits;
    read as such, summed in float32); layer: i32 scalar; pages: i32[R, L] page tables; rows: i32[S]
    each query's page table; lens: i32[S] (0 for padding, which gets zeros); wide: 16-lane vectors
    (None: `wide_vectors()`, where the CPU has them).
    Returns f32[S, kv_head, group, head_dim]."""
    call = jax.ffi.ffi_call("jax_serve_paged_attention", jax.ShapeDtypeStruct(q.shape, jnp.float32))
    sinks = jnp.zeros((0,), jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32)
    keys = v_all if k_all is None else k_all
    return call(q, keys, v_all, jnp.asarray(layer, jnp.int32), pages, rows, lens, jnp.asarray(window, jnp.int32),
                jnp.asarray(0.0 if softcap is None else softcap, jnp.float32), sinks,
                wide=wide_vectors() if wide is None else bool(wide), values_are_keys=k_all is None)


def wide_vectors() -> bool:
    """Whether the attention kernel (with pages of 16 tokens and head sizes that are multiples of
    16) and the matmul's many-row products run on 16-lane vectors (AVX-512F/BW/DQ), else on 8-lane
    ones. A static attribute of each call: a compiled step keeps the path it was traced with."""
    return _cpu_flags() >= {"avx512f", "avx512bw", "avx512dq"}


def silu_mul(gate_up: jax.Array) -> jax.Array:
    """f32[M, N] = silu(gate) * up, where each row of gate_up [M, 2N] is gate then up (the fused
    gate/up projection's output, read in place)."""
    m, n = gate_up.shape[0], gate_up.shape[1] // 2
    call = jax.ffi.ffi_call("jax_serve_silu_mul", jax.ShapeDtypeStruct((m, n), jnp.float32))
    return call(gate_up.astype(jnp.float32))


def argmax(x: jax.Array) -> jax.Array:
    """i32[R]: the index of each row's maximum in f32[R, V] (the first, as jnp.argmax), for rows
    without NaN."""
    call = jax.ffi.ffi_call("jax_serve_argmax", jax.ShapeDtypeStruct(x.shape[:1], jnp.int32))
    return call(x.astype(jnp.float32))


def source_digest() -> str:
    """A digest of the kernels' source (what their speed depends on besides the machine)."""
    return hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]


def _cpu_has_avx2_fma_f16c() -> bool:
    return {"avx2", "fma", "f16c"} <= _cpu_flags()


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(flags.split()[2:])


@functools.cache
def _load() -> bool:
    """Build (once per source + jaxlib version), dlopen and register the kernels; False on failure."""
    try:
        library = _build()
        lib = ctypes.cdll.LoadLibrary(str(library))
        for target, symbol in _SYMBOLS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, AttributeError) as e:
        logger.warning("CPU kernels unavailable (%s); using XLA's ops", e)
        return False
    return True


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        raise OSError("no C++ compiler (set CXX or install g++)")
    flags = ["-O3", "-std=c++17", "-shared", "-fPIC", "-mavx2", "-mfma", "-mf16c", "-fno-math-errno"]
    key = hashlib.sha256(_SOURCE.read_bytes() + jax.__version__.encode() + " ".join(flags).encode()).hexdigest()
    root = Path(os.environ.get("JAX_SERVE_CACHE") or "~/.cache/jax-serve").expanduser() / "kernels"
    library = root / f"cpu_kernels-{key[:16]}.so"
    if library.is_file():
        return library
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        out = Path(tmp) / library.name
        build = subprocess.run([compiler, *flags, "-I", jax.ffi.include_dir(), str(_SOURCE), "-o", str(out)],
                               capture_output=True, text=True)
        if build.returncode != 0:
            raise OSError(f"{compiler} failed to build {_SOURCE.name}: {build.stderr[-1000:]}")
        os.replace(out, library)  # atomic: concurrent builders race harmlessly
    logger.info("built CPU kernels %s", library)
    return library
