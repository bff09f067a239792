"""The liveness rule of a background worker thread (the engine's step loop, the embedding worker):
it can no longer serve once one call into its engine has run past the watchdog, or once its
thread is gone. Pure Python."""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

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
