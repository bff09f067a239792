"""Runs an embedding engine on a background thread and merges concurrent callers into batches.

Any object with the `EmbeddingCore` surface works (the real `EmbeddingEngine`, or a fake in
serving tests). Only the worker thread calls the engine's `embed`. Each caller's inputs become a
job on a queue; the worker takes every job that is waiting (up to `max_batch` inputs in all, a
larger job alone), embeds them in one call and hands each caller its rows on the caller's own
event loop through `call_soon_threadsafe`. Requests that arrive while a batch runs form the next
one, so batches grow with the load without any waiting window.

Failure is final and reaches every caller: `embed` raising (a failed device), a call running past
`watchdog_s` (found by `check()`, which the replica's health probe calls), or `shutdown()`. A job
registers under the same lock the failure takes, so it is either failed with the others or sees
the failure itself: none waits forever. A cancelled caller's inputs may still be computed; its
result is dropped.

Pure Python: importing this module does not import jax.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Optional, Protocol

import numpy as np

from engine.core.request import EngineDeadError
from engine.liveness import liveness_failure

logger = logging.getLogger(__name__)


class EmbeddingCore(Protocol):
    max_model_len: int
    vocab_size: int
    dimensions: int
    max_batch_size: int
    """Inputs one `embed` call runs best with; the default for AsyncEmbedder's max_batch."""

    def validate(self, token_ids_batch: list[list[int]]) -> None:
        """Raise InvalidRequestError if an input can never be embedded. Thread-safe."""

    def embed(self, batch: list[list[int]]) -> np.ndarray:
        """float32 [len(batch), dimensions], row i the embedding of batch[i]."""

    def compile_progress(self) -> tuple[int, int]:
        """(programs compiled, programs in all) while it compiles ahead of use; (0, 0) if it does not. Thread-safe."""

    def describe(self) -> dict[str, str]: ...


@dataclasses.dataclass(eq=False)
class _Job:
    """One caller's inputs and the future (on the caller's loop) its rows go to."""

    inputs: list[list[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    cancelled: bool = False
    """Set by the caller when it stops waiting (read by the worker, which then skips the job)."""

    def settle(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        """Resolve the future from any thread; a no-op once it is done or its loop has closed."""
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, result, error)
        except RuntimeError:  # the caller's loop is closed: nobody is waiting
            pass


def _settle(future: asyncio.Future, result: Any, error: Optional[BaseException]) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class AsyncEmbedder:
    """Owns the worker thread. `embed()` is the whole request-facing API."""

    def __init__(self, engine: EmbeddingCore, *, max_batch: Optional[int] = None, watchdog_s: float = 600.0):
        self.engine = engine
        self.max_batch = max_batch or engine.max_batch_size
        """Inputs merged into one `embed` call at most (a single larger job runs alone)."""
        self.num_batches = 0
        """`embed` calls made so far (each serves one or more callers)."""
        self._watchdog_s = watchdog_s
        self._jobs: queue.SimpleQueue[Optional[_Job]] = queue.SimpleQueue()
        """Waiting jobs, in arrival order; None wakes the worker to stop."""
        self._held: Optional[_Job] = None
        """A job taken off the queue that did not fit the last batch; it leads the next one."""
        self._pending: set[_Job] = set()
        """Jobs not yet settled: queued or running (guarded by `_lock`)."""
        self._lock = threading.Lock()
        self._error: Optional[BaseException] = None
        """Why the embedder can no longer serve (set once, under `_lock`)."""
        self._call_started: Optional[float] = None
        """time.monotonic() when the running `embed` call began; None between calls."""
        self._stopping = threading.Event()
        self._description = engine.describe()
        self._thread = threading.Thread(target=self._run, name="embedding-loop", daemon=True)
        self._thread.start()

    # ---- request-facing API (any thread with an event loop) ----

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """float32 [len(inputs), dimensions]. Raises InvalidRequestError before anything
        is queued if an input can never be embedded, EngineDeadError if the worker died."""
        self._raise_if_dead()
        self.engine.validate(inputs)
        loop = asyncio.get_running_loop()
        job = _Job([list(ids) for ids in inputs], loop, loop.create_future())
        with self._lock:
            self._raise_if_dead()  # a failure after the check above has not seen this job
            self._pending.add(job)
        self._jobs.put(job)
        try:
            return await job.future
        finally:
            job.cancelled = True  # done or given up: the worker skips it if it has not run yet
            with self._lock:
                self._pending.discard(job)

    def validate(self, inputs: list[list[int]]) -> None:
        """Raise InvalidRequestError if the engine could never embed these inputs (any thread)."""
        self.engine.validate(inputs)

    def describe(self) -> dict[str, str]:
        return self._description

    @property
    def error(self) -> Optional[BaseException]:
        return self._error

    def is_alive(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def check(self) -> None:
        """Raise EngineDeadError unless the embedder can serve. A call past the watchdog, or a worker
        thread that is gone, kills it here: its callers fail now, not when (if) the call returns."""
        failure = liveness_failure(self._call_started, self._watchdog_s, self._thread, "an embedding call", "calls",
                                   "the embedding worker thread")
        if failure is not None:
            self._die(failure)
        self._raise_if_dead()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the worker (after its running call, if it ends within `timeout_s`); every caller
        still waiting, and any that arrives later, fails with EngineDeadError."""
        self._stopping.set()
        self._jobs.put(None)
        self._thread.join(timeout_s)
        self._die(RuntimeError("the embedder was shut down"))

    # ---- worker thread ----

    def _run(self) -> None:
        try:
            while not self._stopping.is_set() and self._error is None:
                batch = self._next_batch()
                if batch:
                    self._run_batch(batch)
        except BaseException as exc:  # the engine is unusable: fail every caller, mark dead
            logger.exception("embedding worker died")
            self._die(exc)

    def _next_batch(self) -> list[_Job]:
        """Block for a job, then take every waiting job that fits `max_batch` inputs in all (the
        first one whatever its size); cancelled jobs are dropped. [] when woken to stop."""
        first, self._held = self._held or self._jobs.get(), None
        batch, size = [], 0
        job: Optional[_Job] = first
        while job is not None:
            if not job.cancelled:
                if batch and size + len(job.inputs) > self.max_batch:
                    self._held = job
                    break
                batch.append(job)
                size += len(job.inputs)
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
        return batch

    def _run_batch(self, batch: list[_Job]) -> None:
        inputs = [ids for job in batch for ids in job.inputs]
        self._call_started = time.monotonic()
        try:
            out = self.engine.embed(inputs)
        finally:
            self._call_started = None
        self.num_batches += 1
        if self._error is not None:  # the watchdog or shutdown failed these callers meanwhile
            return
        start = 0
        for job in batch:
            job.settle(out[start: start + len(job.inputs)])
            start += len(job.inputs)

    def _die(self, cause: BaseException) -> None:
        """Mark the embedder dead (the first cause wins) and fail every pending caller."""
        with self._lock:
            if self._error is not None:
                return
            self._error = cause
            jobs = list(self._pending)
        for job in jobs:
            job.settle(error=EngineDeadError(f"embedding worker died: {cause!r}"))

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"embedding worker died: {self._error!r}; restart the replica")
