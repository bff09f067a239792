"""Per product shape, the fastest of the CPU matmul kernel and XLA's dot, measured on this machine.

Three paths, each reading the layout it is fast on (XLA's dot would transpose panels per product):
the project's kernel (engine/backends/cpu/kernels.cc) over 16-column panels, float32 activations;
XLA's dot (`xla`) over the plain [K, N] matrix, activations rounded to the weights' dtype (as
accelerators run them); XLA's dot in float32 (`xla_f32`), the plain weight widened inside the step
and the activations kept float32 (the kernel's arithmetic). The kernel wins decoding's few-row
products; XLA's dot may win many-row ones on CPUs with AMX or AVX-512. No list of CPU models decides:
every product a step can run (the rows of each shape bucket times each packed weight) is timed on
each path at warm-up and the fastest wins. A weight keeps only the layouts its chosen products
read: one where one path wins all its row counts, both (the memory cost is logged) where they split.

Rules that keep warm-up short: `xla_f32` is timed only for products of `WIDEN_FROM_ROWS` rows or
more (widening costs a pass over the weight per product); XLA's paths only gain on the kernel as a
product's rows grow, so a path `CLEAR_LOSS` times the kernel's time at some row count is not timed
at fewer rows of that weight (cached as null), and a timing stops after two runs once it is that far
behind the kernel on the same product.

The timings are cached as JSON beside XLA's compiled buckets, under a key of this machine (CPU
model, flags and core count), jax's version, the kernel source and the layouts each path reads, so a
restarted replica reuses them. Without measuring (warm-up off), cached choices apply and the rest
stays on the kernel. `cpu_matmul: kernel | xla | xla_f32` overrides every choice.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from engine.backends.cpu import kernels

logger = logging.getLogger(__name__)

KERNEL, XLA, XLA_F32 = "kernel", "xla", "xla_f32"
PATHS = (KERNEL, XLA, XLA_F32)
XLA_PATHS = (XLA, XLA_F32)
"""The paths that read the plain matrix."""
WIDEN_FROM_ROWS = 64
"""The fewest rows at which `xla_f32` is timed (below it, widening the weight costs more than it can win)."""
CLEAR_LOSS = 1.5
"""A path this many times the kernel's time is out of the race: not timed further, nor at fewer rows."""


@dataclasses.dataclass(frozen=True, order=True)
class Product:
    """One matmul shape: f32[rows, depth] @ dtype[depth, width]."""

    rows: int
    depth: int
    width: int
    dtype: str

    @property
    def key(self) -> str:
        return f"{self.rows}x{self.depth}x{self.width}:{self.dtype}"


Timer = Callable[[Product, str, Optional[float]], float]
"""Seconds one product takes on one path; with a bound (the kernel's seconds), it may stop early at
a time of `CLEAR_LOSS` times the bound or more."""


def time_product(product: Product, path: str, bound: Optional[float] = None, repeats: int = 5) -> float:
    """The fastest of `repeats` runs after one that compiles and warms up (the least disturbed by
    whatever else shares the cores). Two runs both `CLEAR_LOSS` times `bound` or more end it: that
    path will not be chosen."""
    if path == KERNEL:
        run, w_shape = jax.jit(kernels.matmul), (product.width // kernels.PANEL, product.depth, kernels.PANEL)
    else:
        run = jax.jit(functools.partial(kernels.xla_matmul, f32=path == XLA_F32))
        w_shape = (product.depth, product.width)
    # operands made on the host: jnp.full would compile a program per shape
    x = jax.device_put(np.ones((product.rows, product.depth), np.float32))
    w = jax.device_put(np.full(w_shape, 0.01, jnp.dtype(product.dtype)))
    run(x, w).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(x, w).block_until_ready()
        times.append(time.perf_counter() - start)
        if bound is not None and len(times) >= 2 and min(times) >= CLEAR_LOSS * bound:
            break
    return min(times)


def paths_for(product: Product) -> tuple[str, ...]:
    """The paths worth timing for `product`: widening to float32 only where the weight is narrower
    and the product has rows enough."""
    wide = product.dtype != "float32" and product.rows >= WIDEN_FROM_ROWS
    return PATHS if wide else (KERNEL, XLA)


class MatmulChooser:
    """Chooses a path per product: the override, else the fastest one (measured or cached)."""

    def __init__(self, cache_file: Optional[Path], override: str = "auto", timer: Optional[Timer] = None):
        if override not in ("auto", *PATHS):
            raise ValueError(f"cpu_matmul must be 'auto', {', '.join(map(repr, PATHS))}, got {override!r}")
        self.cache_file = cache_file
        self.override = override
        self.timer = timer

    def choose(self, products: Iterable[Product], measure: bool, widen: bool = True) -> dict[Product, str]:
        """The path of every product; `measure` times those the cache does not hold. Without
        `widen`, `xla_f32` is neither timed nor chosen (nor forced: the override falls back to `xla`)."""
        products = sorted(set(products))
        allowed = PATHS if widen else (KERNEL, XLA)
        if self.override != "auto":
            return {p: self.override if self.override in allowed else XLA for p in products}
        timings = self._load()
        wanted = {p: [path for path in paths_for(p) if path in allowed] for p in products}
        missing = [p for p in products if not set(wanted[p]) <= set(timings.get(p.key, {}))]
        if measure and missing:
            start = time.perf_counter()
            self._measure(products, missing, wanted, timings)
            logger.info("timed %d CPU matmul shapes in %.1f s", len(missing), time.perf_counter() - start)
            self._save(timings)
        choices = {}
        for p in products:
            known = {path: t for path, t in timings.get(p.key, {}).items() if path in allowed and t is not None}
            choices[p] = min(known, key=known.get) if known else KERNEL
        logger.info("CPU matmul per shape (ms on the kernel / XLA's dot / XLA's dot in float32, -: not timed "
                    "-> chosen):\n%s", _table(choices, timings))
        return choices

    def _measure(self, products: list[Product], missing: list[Product], wanted: dict[Product, list[str]],
                 timings: dict[str, dict[str, Optional[float]]]) -> None:
        """Times each missing product's wanted paths, the kernel first, a weight's most rows first; a
        path that lost clearly at more rows of the same weight is recorded as null (not timed)."""
        timer = self.timer or time_product
        for p in sorted(missing, key=lambda p: (p.depth, p.width, p.dtype, -p.rows)):
            known = timings.setdefault(p.key, {})
            more_rows = [timings.get(q.key, {}) for q in products
                         if (q.depth, q.width, q.dtype) == (p.depth, p.width, p.dtype) and q.rows > p.rows]
            for path in sorted(wanted[p], key=lambda path: path != KERNEL):
                if path in known:
                    continue
                if path != KERNEL and any(_lost(t, path) for t in more_rows):
                    known[path] = None
                else:
                    known[path] = timer(p, path, known.get(KERNEL) if path != KERNEL else None)

    def _load(self) -> dict[str, dict[str, Optional[float]]]:
        if self.cache_file is None or not self.cache_file.is_file():
            return {}
        try:
            return json.loads(self.cache_file.read_text()).get(machine_key(), {})
        except (OSError, ValueError):
            logger.warning("ignoring an unreadable CPU matmul cache %s", self.cache_file)
            return {}

    def _save(self, timings: dict[str, dict[str, Optional[float]]]) -> None:
        if self.cache_file is None:
            return
        try:
            every = json.loads(self.cache_file.read_text()) if self.cache_file.is_file() else {}
        except (OSError, ValueError):
            every = {}
        every[machine_key()] = timings
        self.cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(every, indent=1, sort_keys=True))
        os.replace(tmp, self.cache_file)  # atomic: replicas starting together race harmlessly


LAYOUTS = "kernel: 16-column panels; xla: the plain [K, N] matrix; xla_f32: the plain matrix widened in the step"
"""What each path's timing reads: part of the cache key, so that timings of other layouts never apply."""


@functools.cache
def machine_key() -> str:
    """What the timings depend on: the CPU (model, flags, cores), jax's version, the kernel source,
    the layouts each path reads."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        cpuinfo = []
    cpu = [line for line in cpuinfo if line.startswith(("model name", "flags"))][:2]
    parts = [*cpu, str(os.cpu_count()), jax.__version__, kernels.source_digest(), LAYOUTS]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _lost(timing: dict[str, Optional[float]], path: str) -> bool:
    """Whether `path` was out of the race in one product's timings: clearly slower than the kernel,
    or itself not timed for losing at more rows."""
    if path not in timing or KERNEL not in timing:
        return False
    return timing[path] is None or timing[path] >= CLEAR_LOSS * timing[KERNEL]


def _table(choices: dict[Product, str], timings: dict[str, dict[str, Optional[float]]]) -> str:
    lines = []
    for p, path in choices.items():
        t = timings.get(p.key)
        measured = "not measured" if t is None else " / ".join(
            f"{1e3 * t[path]:8.3f}" if t.get(path) is not None else f"{'-':>8s}" for path in PATHS)
        lines.append(f"  {p.rows:5d} x {p.depth:5d} x {p.width:6d} {p.dtype:8s} {measured} -> {path}")
    return "\n".join(lines)
