"""The spine of every engine driver: one background thread driving an engine for callers on asyncio
event loops, a watchdog over each engine call, and failure that is final.

`Worker` is extended by the three drivers (engine.generate.driver's AsyncEngine, engine.embed.driver's
AsyncEmbedder, engine.transcribe.driver's AsyncTranscriber). A driver's callers put work on `_queue`
through `_submit` (None wakes the thread to stop), each with an `Inbox` on its own event loop; the
thread runs the driver's `_work` until it stops or fails, and hands each caller its results through
its inbox.

Failure reaches every caller waiting: the loop raising (a failed device, a lost host), an engine
call past `watchdog_s` (found by `check()`, which the replica's health probe calls; the stuck call
cannot be interrupted, so its callers are failed without it), or `shutdown()`. A caller registers
under the same lock the failure takes, so it either is failed with the others or sees the failure
itself: none waits forever. A caller whose event loop has closed is unreachable (`Inbox.put` says
so); the thread lives on.

Pure Python: importing this module does not import jax.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, Callable, Generic, Hashable, Iterable, Optional, TypeVar

from engine.errors import EngineDeadError, InvalidRequestError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Inbox(Generic[T]):
    """What the worker thread hands one caller, queued on the caller's event loop (the one running
    when the inbox is made): items in order, or an exception, which the caller raises."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._items: asyncio.Queue[T | BaseException] = asyncio.Queue()

    def put(self, item: T | BaseException) -> bool:
        """Queue `item` for the caller (from any thread); False if the caller's event loop has
        closed, so nobody will ever read this inbox (the caller's `finally` may never run)."""
        try:
            self.loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:  # the loop is closed: the only error call_soon_threadsafe raises here
            return False
        return True

    async def get(self) -> T:
        """The next item (on the caller's loop); an exception put in it is raised here."""
        item = await self._items.get()
        if isinstance(item, BaseException):
            raise item
        return item


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


class Worker:
    """One thread driving an engine, its registered callers and its liveness.

    `name` says what died in a caller's error ("engine loop": "engine loop died: ..."); `thread`
    names the thread; `call` and `calls` name one engine call and the calls in a watchdog error;
    `stopped` is the cause a shutdown gives. A subclass runs one turn of its loop in `_work`, makes
    each engine call through `_call`, and calls `_start()` at the end of its constructor."""

    def __init__(self, name: str, *, thread: str, call: str, calls: str, stopped: str, watchdog_s: float):
        self._name = name
        self._stopped = stopped
        self._watchdog_s = watchdog_s
        self._names = (call, calls, f"the {name} thread")
        """How `check`'s errors name one call, the calls and the thread (see `liveness_failure`)."""
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        """Arriving work, in order; None wakes the thread to stop."""
        self._callers: dict[Hashable, Inbox] = {}
        """Each caller not yet settled, by its key (guarded by `_lock`)."""
        self._lock = threading.Lock()
        """Guards `_callers`, and `_error` as `_die` sets it."""
        self._error: Optional[BaseException] = None
        """Why the worker can no longer serve (set once, by `_die`)."""
        self._call_started: Optional[float] = None
        """time.monotonic() when the running engine call began; None between calls."""
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=thread, daemon=True)

    # ---- the surface ----

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

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the thread (after its running call, if it ends within `timeout_s`, and the
        subclass's `_wind_down`); every caller still waiting, and any that arrives later, fails
        with EngineDeadError."""
        self._stopping.set()
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._die(RuntimeError(self._stopped))

    def num_callers(self) -> int:
        """Callers registered and not yet settled (an open stream, a job not yet answered)."""
        with self._lock:
            return len(self._callers)

    # ---- for subclasses ----

    def _work(self) -> None:
        """One turn of the thread's loop (called until it stops or fails)."""
        raise NotImplementedError

    def _wind_down(self) -> None:
        """After the loop stopped on `shutdown` (not on a failure), on the thread: let the engine
        release what it holds. Nothing by default."""

    def _start(self) -> None:
        self._thread.start()

    def _submit(self, key: Hashable, inbox: Inbox, work: Any) -> None:
        """Register the caller `key` (a request id, or its job) with its inbox and queue `work`.
        EngineDeadError if the worker is dead; InvalidRequestError if `key` is already registered."""
        with self._lock:
            self._raise_if_dead()  # a failure after any earlier check has not seen this caller
            if key in self._callers:
                raise InvalidRequestError(f"request id {key!r} is already running", "request_id")
            self._callers[key] = inbox
        self._queue.put(work)

    def _settled(self, key: Hashable, inbox: Inbox) -> None:
        """Forget the caller `key` if `inbox` is still its own (from any thread; failure no longer reaches it)."""
        with self._lock:
            if self._callers.get(key) is inbox:
                del self._callers[key]

    def _inboxes(self, keys: Iterable[Hashable]) -> list[Optional[Inbox]]:
        """The inbox of each caller of `keys` (None: not registered)."""
        with self._lock:
            return [self._callers.get(key) for key in keys]

    def _keys(self) -> list[Hashable]:
        """Every registered caller's key."""
        with self._lock:
            return list(self._callers)

    def _call(self, method: Callable, *args: Any) -> Any:
        """`method(*args)`, timed for the watchdog."""
        self._call_started = time.monotonic()
        try:
            return method(*args)
        finally:
            self._call_started = None

    # ---- internals ----

    def _run(self) -> None:
        try:
            while not self._stopping.is_set() and self._error is None:
                self._work()
            if self._error is None:
                self._wind_down()
        except BaseException as exc:  # the engine is unusable: fail every caller, mark dead
            logger.exception("%s died", self._name)
            self._die(exc)

    def _die(self, cause: BaseException) -> None:
        """Mark the worker dead (the first cause wins) and fail every registered caller."""
        with self._lock:
            if self._error is not None:
                return
            self._error = cause
            inboxes = list(self._callers.values())
        for inbox in inboxes:
            inbox.put(EngineDeadError(f"{self._name} died: {cause!r}"))

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"{self._name} died: {self._error!r}; restart the replica")
