"""The spine of every engine's background worker: one thread driving an engine, a watchdog over
each engine call, and failure that is final.

`WatchedWorker`: the liveness rule. A worker can no longer serve once one call into its engine has
run past the watchdog, or once its thread is gone.
`JobWorker` (the embedding and speech workers): callers' jobs on a queue. A subclass puts jobs on
`_queue` (None wakes the thread to stop), runs its loop in `_work` and fails a job with
`_fail(job, error)`. A job registers under the same lock the failure takes, so it is either failed
with the others or sees the failure itself: none waits forever. Failure reaches every caller: the
loop raising (a failed device), an engine call past `watchdog_s` (found by `check()`, which the
replica's health probe calls), or `shutdown()`.

Pure Python: importing this module does not import jax.
"""


from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Optional

from engine.errors import EngineDeadError

logger = logging.getLogger(__name__)


def liveness_failure(call_started: Optional[float], watchdog_s: float, thread: threading.Thread, call: str,
                     calls: str, worker: str) -> Optional[BaseException]:
    """Why the worker is dead, or None: `call` (e.g. "an engine step") started at `call_started`
    (time.monotonic(); None between calls) and still running past `watchdog_s`, or `worker`'s
    `thread` no longer alive. `calls` names them in the plural for the error's advice."""
    stuck_s = 0.0 if call_started is None else time.monotonic() - call_started
    if stuck_s > watchdog_s:
        stuck = TimeoutError(f"{call} has not returned for {stuck_s:.0f} s (watchdog {watchdog_s:g} s; raise "
                             f"step_timeout_s if {calls} are legitimately this slow)")
        logger.error("%s: failing its requests", stuck)
        return stuck
    if not thread.is_alive():
        return RuntimeError(f"{worker} is gone")
    return None


class WatchedWorker:
    """A worker thread whose engine calls the watchdog times: why it died (`error`), whether it can
    serve (`is_alive`) and `check()`, the health probe's test. A subclass runs its loop in `_run`,
    makes each engine call through `_call`, and says in `_die` whom a failure reaches and in
    `_raise_if_dead` what a caller is told."""

    def __init__(self, thread_name: str, watchdog_s: float, call: str, calls: str, worker: str):
        self._watchdog_s = watchdog_s
        self._names = (call, calls, worker)
        """How `check`'s errors name one call, the calls and the thread (see `liveness_failure`)."""
        self._error: Optional[BaseException] = None
        """Why the worker can no longer serve (set once, by `_die`)."""
        self._call_started: Optional[float] = None
        """time.monotonic() when the running engine call began; None between calls."""
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    @property
    def error(self) -> Optional[BaseException]:
        return self._error

    def is_alive(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def check(self) -> None:
        """Raise EngineDeadError unless the worker can serve. A call past the watchdog, or a worker
        thread that is gone, kills it here: its callers fail now, not when (if) the call returns."""
        failure = liveness_failure(self._call_started, self._watchdog_s, self._thread, *self._names)
        if failure is not None:
            self._die(failure)
        self._raise_if_dead()

    def _call(self, method: Callable, *args: Any) -> Any:
        """`method(*args)`, timed for the watchdog."""
        self._call_started = time.monotonic()
        try:
            return method(*args)
        finally:
            self._call_started = None

    def _run(self) -> None:
        raise NotImplementedError

    def _die(self, cause: BaseException) -> None:
        """Mark the worker dead (the first cause wins) and fail everyone waiting on it."""
        raise NotImplementedError

    def _raise_if_dead(self) -> None:
        raise NotImplementedError


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
