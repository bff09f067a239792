"""engine.backends.cpu.matmul_choice: per shape, the fastest of the CPU kernel, XLA's dot and XLA's
dot in float32, with a fake timer (the choice logic, the override, the cache) and with the real one."""

from __future__ import annotations

import json

import pytest

from engine.backends.cpu import kernels as cpu_kernels
from engine.backends.cpu import matmul_choice
from engine.backends.cpu.matmul_choice import (
    KERNEL,
    PATHS,
    XLA,
    XLA_F32,
    MatmulChooser,
    Product,
)

SHAPES = [Product(rows, 64, 192, "bfloat16") for rows in (1, 8, 128, 512)] + [Product(4, 64, 512, "float32")]


class FakeTimer:
    """XLA's dot is faster from 128 rows on, in float32 from 512; every call is recorded."""

    def __init__(self):
        self.calls = []

    def __call__(self, product, path, bound=None):
        self.calls.append((product, path))
        fast_xla = product.rows >= 128
        return {KERNEL: 2.0 if fast_xla else 1.0, XLA: 1.0 if fast_xla else 3.0,
                XLA_F32: 0.5 if product.rows >= 512 else 1.5}[path]


def test_the_fastest_path_wins_per_shape(tmp_path):
    """Widening to float32 is timed only for bf16 weights from 64 rows (the 128- and 512-row ones).
    XLA's dot, 3x the kernel's time at 8 rows, is not timed at 1 row of the same weight."""
    timer = FakeTimer()
    choices = MatmulChooser(tmp_path / "m.json", timer=timer).choose(SHAPES, measure=True)
    assert [choices[p] for p in SHAPES] == [KERNEL, KERNEL, XLA, XLA_F32, KERNEL]
    wide = {SHAPES[2], SHAPES[3]}
    timed = [(p, path) for p in SHAPES for path in PATHS if (path != XLA_F32 or p in wide) and (p, path) != (SHAPES[0], XLA)]
    assert sorted(timer.calls) == sorted(timed)


def test_a_path_out_of_the_race_is_not_timed_at_fewer_rows(tmp_path):
    """Each weight is timed from its most rows down, the kernel first, and every path gets the
    kernel's time as its bound. A path 1.5x the kernel's time or more is recorded as not timed
    (null) at fewer rows of that weight, and a restart takes those as known; a path within 1.5x
    stays in the race, and another weight's timings do not count."""
    shapes = [Product(rows, 64, 192, "bfloat16") for rows in (1, 8, 32, 64)] + [Product(8, 64, 512, "bfloat16")]

    def timer(product, path, bound=None):
        calls.append((product.rows, product.width, path, bound))
        if path == KERNEL:
            return 1.0
        return {64: 1.2, 32: 1.4, 8: 1.6}[product.rows] if path == XLA else 2.0  # xla_f32: out at 64 rows

    calls = []
    cache = tmp_path / "m.json"
    choices = MatmulChooser(cache, timer=timer).choose(shapes, measure=True)
    assert calls == [(64, 192, KERNEL, None), (64, 192, XLA, 1.0), (64, 192, XLA_F32, 1.0),
                     (32, 192, KERNEL, None), (32, 192, XLA, 1.0), (8, 192, KERNEL, None), (8, 192, XLA, 1.0),
                     (1, 192, KERNEL, None), (8, 512, KERNEL, None), (8, 512, XLA, 1.0)]
    assert set(choices.values()) == {KERNEL}
    timings = json.loads(cache.read_text())[matmul_choice.machine_key()]
    assert timings["1x64x192:bfloat16"] == {KERNEL: 1.0, XLA: None}
    calls.clear()
    assert MatmulChooser(cache, timer=timer).choose(shapes, measure=True) == choices and calls == []


def test_a_timing_far_behind_its_bound_stops_after_two_runs(monkeypatch):
    """Every run of the fake clock takes 1 s: against a bound of 0.5 s (1 s is 2x it) the timing
    stops after two runs; against 1 s, or without a bound, all five run."""

    class Clock:
        now = 0.0

        def perf_counter(self):
            self.now += 1.0  # a run reads it at its start and its end: 1 s apart
            return self.now

    class Run:
        def __init__(self):
            self.runs = 0

        def __call__(self, fn):
            def run(*args):
                self.runs += 1
                return fn(*args)
            return run

    product = Product(8, 64, 32, "float32")
    for bound, runs in ((0.5, 1 + 2), (1.0, 1 + 5), (None, 1 + 5)):
        counter = Run()
        monkeypatch.setattr(matmul_choice, "time", Clock())
        monkeypatch.setattr(matmul_choice.jax, "jit", counter)
        assert matmul_choice.time_product(product, XLA, bound) == 1.0
        assert counter.runs == runs, bound


def test_without_widening_the_float32_dot_is_neither_timed_nor_chosen(tmp_path):
    """A host without memory for a step's widened weights: the 512-row product goes to XLA's bf16
    dot, even from a cache that holds its float32 timing; a forced xla_f32 becomes xla."""
    cache = tmp_path / "m.json"
    MatmulChooser(cache, timer=FakeTimer()).choose(SHAPES, measure=True)
    timer = FakeTimer()
    choices = MatmulChooser(cache, timer=timer).choose(SHAPES, measure=True, widen=False)
    assert [choices[p] for p in SHAPES] == [KERNEL, KERNEL, XLA, XLA, KERNEL] and timer.calls == []
    forced = MatmulChooser(cache, override=XLA_F32).choose(SHAPES, measure=True, widen=False)
    assert set(forced.values()) == {XLA}


def test_a_shape_timed_without_widening_gets_its_float32_timing_later(tmp_path):
    cache = tmp_path / "m.json"
    MatmulChooser(cache, timer=FakeTimer()).choose(SHAPES, measure=True, widen=False)
    timer = FakeTimer()
    choices = MatmulChooser(cache, timer=timer).choose(SHAPES, measure=True)
    assert sorted(timer.calls) == [(SHAPES[2], XLA_F32), (SHAPES[3], XLA_F32)]  # only what the cache lacked
    assert choices[SHAPES[3]] == XLA_F32


@pytest.mark.parametrize("override", [KERNEL, XLA, XLA_F32])
def test_the_override_wins_over_both(tmp_path, override):
    timer = FakeTimer()
    choices = MatmulChooser(tmp_path / "m.json", override=override, timer=timer).choose(SHAPES, measure=True)
    assert set(choices.values()) == {override} and len(choices) == len(SHAPES)
    assert timer.calls == []


def test_a_restart_reuses_the_cache_and_times_only_new_shapes(tmp_path):
    cache = tmp_path / "xla" / "cpu_matmul.json"
    first = MatmulChooser(cache, timer=FakeTimer()).choose(SHAPES[:3], measure=True)
    stored = json.loads(cache.read_text())[matmul_choice.machine_key()]
    assert stored[SHAPES[2].key] == {KERNEL: 2.0, XLA: 1.0, XLA_F32: 1.5}
    timer = FakeTimer()
    again = MatmulChooser(cache, timer=timer).choose(SHAPES, measure=True)
    assert {p: again[p] for p in SHAPES[:3]} == first
    assert {p for p, _ in timer.calls} == set(SHAPES[3:])  # only the shapes the cache lacked


def test_without_measuring_cached_choices_apply_and_the_rest_stays_on_the_kernel(tmp_path):
    cache = tmp_path / "cpu_matmul.json"
    MatmulChooser(cache, timer=FakeTimer()).choose(SHAPES[2:3], measure=True)
    timer = FakeTimer()
    choices = MatmulChooser(cache, timer=timer).choose(SHAPES, measure=False)
    assert [choices[p] for p in SHAPES] == [KERNEL, KERNEL, XLA, KERNEL, KERNEL]
    assert timer.calls == []


def test_another_machine_does_not_reuse_the_timings(tmp_path, monkeypatch):
    cache = tmp_path / "cpu_matmul.json"
    MatmulChooser(cache, timer=FakeTimer()).choose(SHAPES, measure=True)
    monkeypatch.setattr(matmul_choice, "machine_key", lambda: "another-cpu")
    timer = FakeTimer()
    MatmulChooser(cache, timer=timer).choose(SHAPES[:1], measure=True)
    assert len(timer.calls) == 2
    assert len(json.loads(cache.read_text())) == 2  # both machines' timings are kept


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs an x86 CPU with AVX2 + FMA and g++")
def test_the_real_timer_runs_every_path():
    product = Product(64, 64, 32, "bfloat16")
    assert all(0 < matmul_choice.time_product(product, path) < 1.0 for path in PATHS)
