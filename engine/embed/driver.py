"""Runs an embedding engine on a background thread and merges concurrent callers into batches.

Any object that follows `EmbeddingEngineProtocol` works (the real `EmbeddingEngine`, or a fake in
serving tests). Only the worker thread calls the engine's `embed`. Each caller's inputs become a
job on a queue; the worker takes every job that is waiting (up to `max_batch` inputs in all, a
larger job alone), embeds them in one call and hands each caller its rows on the caller's own
event loop (engine.worker's `Inbox`). Requests that arrive while a batch runs form the next
one, so batches grow with the load without any waiting window.

Failure is final and reaches every caller (engine.worker: `embed` raising, a call past
`watchdog_s`, `shutdown()`). A cancelled caller's inputs may still be computed; its result is
dropped.

Pure Python: importing this module does not import jax.
"""

from __future__ import annotations

import dataclasses
import queue
from typing import Optional, Protocol

import numpy as np

from engine.worker import Inbox, Worker


class EmbeddingEngineProtocol(Protocol):
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
    """One caller's inputs and the inbox (on the caller's loop) its rows go to."""

    inputs: list[list[int]]
    inbox: Inbox[np.ndarray]
    cancelled: bool = False
    """Set by the caller when it stops waiting (read by the worker, which then skips the job)."""


class AsyncEmbedder(Worker):
    """Owns the worker thread over `engine`. `embed()` is the whole request-facing API."""

    def __init__(self, engine: EmbeddingEngineProtocol, *, max_batch: Optional[int] = None, watchdog_s: float = 600.0):
        super().__init__("embedding worker", thread="embedding-loop", call="an embedding engine call", calls="calls",
                         stopped="the embedding worker was shut down", watchdog_s=watchdog_s)
        self.engine = engine
        self.max_batch = max_batch or engine.max_batch_size
        """Inputs merged into one `embed` call at most (a single larger job runs alone)."""
        self.num_batches = 0
        """`embed` calls made so far (each serves one or more callers)."""
        self._held: Optional[_Job] = None
        """A job taken off the queue that did not fit the last batch; it leads the next one."""
        self._description = engine.describe()
        self._start()

    # ---- request-facing API (any thread with an event loop) ----

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """float32 [len(inputs), dimensions]. Raises InvalidRequestError before anything
        is queued if an input can never be embedded, EngineDeadError if the worker died."""
        self._raise_if_dead()
        self.engine.validate(inputs)
        job = _Job([list(ids) for ids in inputs], Inbox())
        self._submit(job, job.inbox, job)
        try:
            return await job.inbox.get()
        finally:
            job.cancelled = True  # done or given up: the worker skips it if it has not run yet
            self._settled(job, job.inbox)

    def validate(self, inputs: list[list[int]]) -> None:
        """Raise InvalidRequestError if the engine could never embed these inputs (any thread)."""
        self.engine.validate(inputs)

    def describe(self) -> dict[str, str]:
        return self._description

    # ---- worker thread ----

    def _work(self) -> None:
        batch = self._next_batch()
        if batch:
            self._run_batch(batch)

    def _next_batch(self) -> list[_Job]:
        """Block for a job, then take every waiting job that fits `max_batch` inputs in all (the
        first one whatever its size); cancelled jobs are dropped. [] when woken to stop."""
        first, self._held = self._held or self._queue.get(), None
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
                job = self._queue.get_nowait()
            except queue.Empty:
                break
        return batch

    def _run_batch(self, batch: list[_Job]) -> None:
        inputs = [ids for job in batch for ids in job.inputs]
        out = self._call(self.engine.embed, inputs)
        self.num_batches += 1
        if self._error is not None:  # the watchdog or shutdown failed these callers meanwhile
            return
        start = 0
        for job in batch:
            job.inbox.put(out[start: start + len(job.inputs)])
            start += len(job.inputs)
