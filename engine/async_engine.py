"""Runs an engine's `step()` on a background thread and gives each request an async stream.

Any object with the `EngineCore` surface works (the real `LLMEngine`, or a fake in serving tests).
The engine itself is single-threaded: only the loop thread touches it. Callers talk to the loop
through a command queue; deltas come back to each request's asyncio queue through
`call_soon_threadsafe`. Closing or cancelling a request's iterator aborts it in the engine, so a
client that goes away returns its KV pages.

Pure Python: importing this module does not import jax.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator, Optional, Protocol

from engine.core.request import EngineDeadError, EngineStats, InvalidRequestError, SamplingParams, TokenDelta

logger = logging.getLogger(__name__)


class EngineCore(Protocol):
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError if the request can never be served. Thread-safe."""

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def step(self) -> list[TokenDelta]: ...

    def has_work(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def describe(self) -> dict[str, str]:
        """How the engine runs its model (attention backend, dtypes, devices, mesh): fixed at start."""

    def heartbeat(self) -> None:
        """Optional: raise if the engine can no longer serve (a lost host). Called while idle."""


class _Stream:
    """One request's delivery queue, living on the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[TokenDelta | BaseException] = asyncio.Queue()

    def put(self, item: TokenDelta | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """Owns the loop thread. `generate()` is the whole request-facing API."""

    def __init__(self, core: EngineCore, *, idle_wait_s: float = 0.05, heartbeat_s: float = 1.0):
        self.core = core
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams
        self._idle_wait_s = idle_wait_s
        self._heartbeat_s = heartbeat_s
        self._error: Optional[BaseException] = None
        self._stats = core.stats()
        self._description = core.describe()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- request-facing API (any thread with an event loop) ----

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        """Stream the request's deltas until one has a finish reason. Raises InvalidRequestError
        before anything is queued if the request can never fit, EngineDeadError if the loop died."""
        self._raise_if_dead()
        self.validate(prompt_ids, params)
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already running", "request_id")
            self._streams[request_id] = stream
        self._commands.put(("add", request_id, list(prompt_ids), params))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError if the engine could never serve this request (any thread)."""
        self.core.validate(prompt_ids, params)

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with a delta whose finish reason is `abort`."""
        self._commands.put(("abort", request_id))

    def stats(self) -> EngineStats:
        """The snapshot taken after the most recent step (cheap; no lock on the engine)."""
        return self._stats

    def describe(self) -> dict[str, str]:
        return self._description

    @property
    def error(self) -> Optional[BaseException]:
        return self._error

    def is_alive(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(("wake",))
        self._thread.join(timeout_s)

    # ---- loop thread ----

    def _run(self) -> None:
        heartbeat, last_beat = getattr(self.core, "heartbeat", None), time.monotonic()
        try:
            while not self._stopping.is_set():
                self._drain_commands(block=not self.core.has_work())
                if heartbeat is not None and not self.core.has_work() and time.monotonic() - last_beat > self._heartbeat_s:
                    heartbeat()  # an idle engine still finds out that it lost a host
                    last_beat = time.monotonic()
                deltas = self.core.step() if self.core.has_work() else []
                self._stats = self.core.stats()  # before delivery: a finished stream sees its pages freed
                self._deliver(deltas)
        except BaseException as exc:  # the engine is unusable: fail every stream, mark dead
            logger.exception("engine loop died")
            self._error = exc
            self._fail_all(EngineDeadError(f"engine loop died: {exc!r}"))

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt_ids, params = command
            with self._lock:
                stream = self._streams.get(request_id)
            if stream is None:  # the caller gave up before the loop saw the request
                return
            try:
                self.core.add_request(request_id, prompt_ids, params)
            except InvalidRequestError as exc:
                stream.put(exc)
        elif kind == "abort":
            self.core.abort(command[1])

    def _deliver(self, deltas: list[TokenDelta]) -> None:
        with self._lock:
            targets = [(self._streams.get(d.request_id), d) for d in deltas]
        for stream, delta in targets:
            if stream is not None:
                stream.put(delta)
            elif not delta.finished:  # nobody listens any more
                self.core.abort(delta.request_id)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.put(exc)

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine loop died: {self._error!r}; restart the replica")
