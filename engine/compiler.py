"""Compiling a runner's step programs ahead of use, so that a replica answers while it compiles.

A step runs in one of a few buckets (engine.step.buckets); each bucket is one forward program and
the common sampler variants for its rows. `StepCompiler.start` compiles the first bucket of a
fixed order (`ShapeBuckets.compile_order`: the one a full batch of decodes fits) before it
returns, then the others one by one on a background thread, smallest first. The engine plans every
step with the buckets that are ready (`ready()`), so a step never waits for a compile it can avoid:
until the larger programs are in, a long prompt is read in smaller pieces.

Every host of a multi-host replica compiles the same programs in the same order (the order is a
function of the engine config alone), and the leader plans with the buckets every host has.

Compiling never runs a program: it lowers the jitted functions with the real arguments' types and
compiles them, which fills jit's own cache, so the step that first runs a bucket finds its
executable. The background thread runs at a lower priority than the engine's (Linux niceness is
per thread), which covers tracing and lowering only: XLA's own compiling runs on jaxlib's compile
threads, at the engine's niceness (most of a background compile's CPU time: docs/benchmarks.md).
A compile that fails is raised to the engine at its next step (it would fail the same way on
first use).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Generic, Hashable, Optional, TypeVar

import jax

logger = logging.getLogger(__name__)

BACKGROUND_NICENESS = 10
"""Added to the compile thread's niceness: the engine's steps come first."""


B = TypeVar("B", bound=Hashable)
"""A bucket: engine.step.buckets.Bucket for the LLM engine, (rows, length) for the embedding engine."""


class StepCompiler(Generic[B]):
    """Compiles `order` with `compile_bucket`: the first now, the rest in the background."""

    def __init__(self, order: list[B], compile_bucket: Callable[[B], None], describe: Callable[[B], str] = repr,
                 first: int = 1):
        self.order = list(order)
        self.first = first
        """Buckets of `order` compiled before `start` returns: together they can serve any request."""
        self._compile_bucket = compile_bucket
        self._describe = describe
        self._ready: list[B] = []
        self._error: Optional[BaseException] = None
        self._done = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._started: Optional[float] = None
        self.fingerprints: list[str] = []
        """What was compiled, in order (each bucket's repr): equal on every host of a replica."""

    def start(self, background: bool = True) -> float:
        """Compile the first `first` buckets (all of them with `background=False`); the rest go on in
        the background. Returns the seconds until the first ones were ready."""
        self._started = time.perf_counter()
        for bucket in self.order[:self.first]:
            self._compile(bucket)
        seconds = time.perf_counter() - self._started
        logger.info("step programs 1-%d/%d %s ready in %.1f s: serving; the rest compile in the background",
                    self.first, len(self.order), ", ".join(map(self._describe, self.order[:self.first])), seconds)
        if background and len(self.order) > self.first:
            thread = threading.Thread(target=self._compile_rest, name="step-compiler", daemon=True)
            thread.start()
            # At exit, stop after the compile in progress and wait for it: a thread killed inside XLA
            # aborts the process. Registered after jax's own exit handler, so run before it (atexit is
            # last in, first out): that one clears the backends and caches the compile is using.
            atexit.register(_stop_and_join, self._stop, thread)
        else:
            self._compile_rest(lower_priority=False)
            self.ready()  # raises what failed
        return seconds

    def stop(self) -> None:
        """Compile nothing more after the program in progress (the engine is shutting down)."""
        self._stop.set()

    def ready(self) -> list[B]:
        """The buckets a step may take now, smallest first: the compiled ones, or every one if
        compiling never started (each compiles on first use). Raises what a background compile raised."""
        if self._error is not None:
            raise RuntimeError(f"compiling a step program failed: {self._error!r}") from self._error
        with self._lock:
            return sorted(self._ready if self._started is not None else self.order)

    def progress(self) -> tuple[int, int]:
        """(programs compiled, programs in all); (0, 0) if compiling never started."""
        with self._lock:
            return (len(self._ready), len(self.order)) if self._started is not None else (0, 0)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the compiling ends (every bucket, a failure, or `stop`); True if all are
        compiled. At once False if compiling never started."""
        if self._started is None:
            return False
        self._done.wait(timeout)
        return self._done.is_set() and self.progress()[0] == len(self.order)

    # ---- internals ----

    def _compile(self, bucket: B) -> None:
        self._compile_bucket(bucket)
        with self._lock:
            self._ready.append(bucket)
            self.fingerprints.append(repr(bucket))

    def _compile_rest(self, lower_priority: bool = True) -> None:
        if lower_priority:
            _lower_priority()
        try:
            for i, bucket in enumerate(self.order[self.first:], start=self.first + 1):
                if self._stop.is_set():
                    return
                start = time.perf_counter()
                self._compile(bucket)
                logger.info("step program %d/%d %s compiled in %.1f s", i, len(self.order), self._describe(bucket),
                            time.perf_counter() - start)
            logger.info("all %d step programs compiled in %.1f s", len(self.order), time.perf_counter() - self._started)
        except BaseException as exc:  # noqa: BLE001 -- handed to the engine's next step
            logger.exception("compiling a step program failed")
            self._error = exc
        finally:
            self._done.set()


def _stop_and_join(stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    thread.join()


def _lower_priority() -> None:
    try:
        current = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, current + BACKGROUND_NICENESS))
    except (OSError, AttributeError):  # not Linux, or not permitted: compile at the same priority
        pass


def enable_compilation_cache(path: str) -> None:
    """Persist compiled executables (process-wide jax setting; the same path for every engine).
    A URL (`gs://bucket/dir`) goes to JAX as it is: the hosts of a slice can share one cache.

    A local directory keeps every program, down to the small ones that loading and packing the
    weights run once each (compiling them costs more than reading them back; docs/benchmarks.md).
    A URL keeps only those that took 0.5 s or more to compile: there a read is a round trip to the
    store."""
    if "://" in path:
        directory, min_compile_s = path, 0.5
    else:
        local = Path(path).expanduser()
        local.mkdir(parents=True, exist_ok=True)
        directory, min_compile_s = str(local), 0.0
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)
