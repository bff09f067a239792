"""What the embedding and speech workers share: one background thread driving an engine for jobs
that callers await on their own event loops, and failure that is final.

A subclass puts jobs on `_queue` (None wakes the thread to stop), runs its loop in `_work` and
fails a job with `_fail(job, error)`. A job registers under the same lock the failure takes, so it
is either failed with the others or sees the failure itself: none waits forever. Failure reaches
every caller: the loop raising (a failed device), an engine call past `watchdog_s` (found by
`check()`, which the replica's health probe calls), or `shutdown()`.

Pure Python: importing this module does not import jax.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from engine.core.request import EngineDeadError
from engine.liveness import WatchedWorker

logger = logging.getLogger(__name__)


class JobWorker(WatchedWorker):
    """A worker thread named `kind` ("embedding", "speech") and its callers' jobs."""

    def __init__(self, kind: str, watchdog_s: float):
        super().__init__(f"{kind}-loop", watchdog_s, f"a {kind} engine call", "calls", f"the {kind} worker thread")
        self._kind = kind
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        """Arriving jobs, in order; None wakes the worker to stop."""
        self._pending: set[Any] = set()
        """Jobs not yet settled: queued or running (guarded by `_lock`)."""
        self._lock = threading.Lock()
        """Guards `_pending`, and `_error` as `_die` sets it."""
        self._stopping = threading.Event()

    # ---- for subclasses ----

    def _work(self) -> None:
        """One turn of the worker's loop (called until it stops or fails)."""
        raise NotImplementedError

    def _fail(self, job: Any, error: BaseException) -> None:
        """Hand `error` to the caller waiting on `job` (from any thread)."""
        raise NotImplementedError

    def _submit(self, job: Any) -> None:
        """Register `job` and queue it; EngineDeadError if the worker is dead."""
        with self._lock:
            self._raise_if_dead()  # a failure after any earlier check has not seen this job
            self._pending.add(job)
        self._queue.put(job)

    def _settled(self, job: Any) -> None:
        with self._lock:
            self._pending.discard(job)

    # ---- the surface (and WatchedWorker's error, is_alive, check) ----

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the worker (after its running call, if it ends within `timeout_s`); every caller
        still waiting, and any that arrives later, fails with EngineDeadError."""
        self._stopping.set()
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._die(RuntimeError(f"the {self._kind} worker was shut down"))

    # ---- internals ----

    def _run(self) -> None:
        try:
            while not self._stopping.is_set() and self._error is None:
                self._work()
        except BaseException as exc:  # the engine is unusable: fail every caller, mark dead
            logger.exception("%s worker died", self._kind)
            self._die(exc)

    def _die(self, cause: BaseException) -> None:
        """Mark the worker dead (the first cause wins) and fail every pending caller."""
        with self._lock:
            if self._error is not None:
                return
            self._error = cause
            jobs = list(self._pending)
        for job in jobs:
            self._fail(job, EngineDeadError(f"{self._kind} worker died: {cause!r}"))

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"{self._kind} worker died: {self._error!r}; restart the replica")
