"""Runs an engine's `step()` on a background thread and gives each request an async stream.

Any object with the `EngineCore` surface works (the real `LLMEngine`, or a fake in serving tests).
The engine itself is single-threaded: only the loop thread touches it. Callers talk to the loop
through a command queue; deltas come back to each request's asyncio queue through
`call_soon_threadsafe`. Closing or cancelling a request's iterator aborts it in the engine, so a
client that goes away returns its KV pages; so does the caller's event loop closing under an open
iterator (the loop thread finds it when a delivery fails, and lives on).

Failure is final and reaches every stream: the loop raising (a failed device, a lost host), a step
running past `watchdog_s` (found by `check()`, which the replica's health probe calls; the stuck
step cannot be interrupted, so its streams are failed without it), or `shutdown()`. A request
registers its stream under the same lock the failure takes, so it either is failed with the others
or sees the failure itself: none waits forever.

Pure Python: importing this module does not import jax.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator, Optional, Protocol

from engine.errors import EngineDeadError, InvalidRequestError
from engine.generate.request import SamplingParams, TokenDelta
from engine.stats import EngineStats
from engine.worker import WatchedWorker

logger = logging.getLogger(__name__)


class EngineCore(Protocol):
    """What AsyncEngine drives (LLMEngine; fakes in tests). `images` is passed only when a request
    has some: a core of a text-only model may leave it out of its signatures."""

    def validate(self, prompt_ids: list[int], params: SamplingParams, adapter: Optional[str] = None,
                 images: tuple = ()) -> None:
        """Raise InvalidRequestError if the request can never be served. Thread-safe."""

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    adapter: Optional[str] = None, images: tuple = ()) -> None:
        """`adapter`: a LoRA adapter's name (None: the base model); `images`: engine.generate.images.ImageInput."""

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

    def put(self, item: TokenDelta | BaseException) -> bool:
        """Queue `item` for the caller; False if the caller's event loop has closed, so nobody
        will ever read this stream (its generator's `finally` may never run)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the only error call_soon_threadsafe raises here
            return False
        return True


class AsyncEngine(WatchedWorker):
    """Owns the loop thread. `generate()` is the whole request-facing API."""

    def __init__(self, core: EngineCore, *, idle_wait_s: float = 0.05, heartbeat_s: float = 1.0,
                 watchdog_s: float = 600.0):
        super().__init__("engine-loop", watchdog_s, "an engine step", "steps", "the engine loop thread")
        self.core = core
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams, and _error as _die sets it
        self._idle_wait_s = idle_wait_s
        self._heartbeat_s = heartbeat_s
        self._stats = core.stats()
        self._description = core.describe()
        self._stopping = threading.Event()
        self._thread.start()

    # ---- request-facing API (any thread with an event loop) ----

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, adapter: Optional[str] = None,
        images: tuple = (),
    ) -> AsyncIterator[TokenDelta]:
        """Stream the request's deltas until one has a finish reason. `images`: the prompt's
        (engine.generate.images.ImageInput, for a vision-language model). Raises InvalidRequestError
        before anything is queued if the request can never fit, EngineDeadError if the loop died."""
        self._raise_if_dead()
        self.validate(prompt_ids, params, adapter, images)
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            self._raise_if_dead()  # a failure after the check above has not seen this stream
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already running", "request_id")
            self._streams[request_id] = stream
        self._commands.put(("add", request_id, list(prompt_ids), params, adapter, images))
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

    def validate(self, prompt_ids: list[int], params: SamplingParams, adapter: Optional[str] = None,
                 images: tuple = ()) -> None:
        """Raise InvalidRequestError if the engine could never serve this request (any thread)."""
        self.core.validate(prompt_ids, params, adapter, *((images,) if images else ()))

    @property
    def image_layout(self) -> Optional[tuple[int, int]]:
        """(image placeholder token id, tokens per image) of a model that takes images, else None."""
        token = getattr(self.core, "image_token_id", None)
        return None if token is None else (token, self.core.images.tokens_per_image)

    def add_adapter(self, name: str, path: str) -> None:
        """Read a LoRA adapter and serve it as `name` (blocking; the core's `add_adapter` is
        thread-safe). ValueError if the engine cannot serve it."""
        self.core.add_adapter(name, path)

    def remove_adapter(self, name: str) -> bool:
        return self.core.remove_adapter(name)

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with a delta whose finish reason is `abort`."""
        self._commands.put(("abort", request_id))

    def stats(self) -> EngineStats:
        """The snapshot taken after the most recent step (cheap; no lock on the engine)."""
        return self._stats

    def describe(self) -> dict[str, str]:
        return self._description

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop: the engine aborts every request it holds (their pages return), then each
        still-open stream, and any request that arrives later, fails with EngineDeadError."""
        self._stopping.set()
        self._commands.put(("wake",))
        self._thread.join(timeout_s)
        self._die(RuntimeError("the engine was shut down"))

    # ---- loop thread ----

    def _run(self) -> None:
        heartbeat, last_beat = getattr(self.core, "heartbeat", None), time.monotonic()
        try:
            while not self._stopping.is_set() and self._error is None:
                self._drain_commands(block=not self.core.has_work())
                if heartbeat is not None and not self.core.has_work() and time.monotonic() - last_beat > self._heartbeat_s:
                    heartbeat()  # an idle engine still finds out that it lost a host
                    last_beat = time.monotonic()
                deltas = self._step() if self.core.has_work() else []
                self._stats = self.core.stats()  # before delivery: a finished stream sees its pages freed
                if self._error is None:  # the watchdog may have failed the streams while the step ran
                    self._deliver(deltas)
            if self._error is None:
                self._abort_everything()
        except BaseException as exc:  # the engine is unusable: fail every stream, mark dead
            logger.exception("engine loop died")
            self._die(exc)

    def _abort_everything(self) -> None:
        """On shutdown: abort every request and step until the engine holds none (aborted requests
        leave with their last delta), so every KV page is free when the loop ends."""
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self.core.abort(request_id)
        while self.core.has_work():
            self._step()
        self._stats = self.core.stats()

    def _step(self) -> list[TokenDelta]:
        return self._call(self.core.step)

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
            _, request_id, prompt_ids, params, adapter, images = command
            with self._lock:
                stream = self._streams.get(request_id)
            if stream is None:  # the caller gave up before the loop saw the request
                return
            try:
                self.core.add_request(request_id, prompt_ids, params, adapter, *((images,) if images else ()))
            except InvalidRequestError as exc:
                stream.put(exc)
        elif kind == "abort":
            self.core.abort(command[1])

    def _deliver(self, deltas: list[TokenDelta]) -> None:
        with self._lock:
            targets = [(self._streams.get(d.request_id), d) for d in deltas]
        for stream, delta in targets:
            if stream is not None and stream.put(delta):
                continue
            if stream is not None:  # its event loop closed under it
                with self._lock:
                    if self._streams.get(delta.request_id) is stream:
                        del self._streams[delta.request_id]
            if not delta.finished:  # nobody listens any more
                self.core.abort(delta.request_id)

    def _die(self, cause: BaseException) -> None:
        """Mark the engine dead (the first cause wins) and fail every registered stream."""
        with self._lock:
            if self._error is not None:
                return
            self._error = cause
            streams = list(self._streams.values())
        for stream in streams:
            stream.put(EngineDeadError(f"engine loop died: {cause!r}"))

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine loop died: {self._error!r}; restart the replica")
