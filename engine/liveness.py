"""The liveness rule of a background worker thread (the engine's step loop, the embedding and
speech workers): it can no longer serve once one call into its engine has run past the watchdog,
or once its thread is gone. `WatchedWorker` is what those workers share. Pure Python."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

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
