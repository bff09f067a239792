"""Runs an engine's `step()` on a background thread and gives each request an async stream.

Any object that follows `LLMEngineProtocol` works (the real `LLMEngine`, or a fake in serving
tests). The engine itself is single-threaded: only the loop thread touches it. Callers talk to the
loop through a command queue; deltas come back to each request's inbox on the caller's event loop
(engine.worker). Closing or cancelling a request's iterator aborts it in the engine, so a client
that goes away returns its KV pages; so does the caller's event loop closing under an open
iterator (the loop thread finds it when a delivery fails, and lives on).

Failure is final and reaches every stream (engine.worker: the loop raising, a step past
`watchdog_s`, `shutdown()`).

Pure Python: importing this module does not import jax.
"""

from __future__ import annotations

import queue
import time
from typing import AsyncIterator, Optional, Protocol

from engine.errors import InvalidRequestError
from engine.generate.request import SamplingParams, TokenDelta
from engine.stats import EngineStats
from engine.worker import Inbox, Worker


class LLMEngineProtocol(Protocol):
    """What AsyncEngine drives (LLMEngine; fakes in tests). `images` is passed only when a request
    has some: an engine of a text-only model may leave it out of its signatures."""

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


class AsyncEngine(Worker):
    """Owns the loop thread over `engine`. `generate()` is the whole request-facing API."""

    def __init__(self, engine: LLMEngineProtocol, *, idle_wait_s: float = 0.05, heartbeat_s: float = 1.0,
                 watchdog_s: float = 600.0):
        super().__init__("engine loop", thread="engine-loop", call="an engine step", calls="steps",
                         stopped="the engine was shut down", watchdog_s=watchdog_s)
        self.engine = engine
        """The engine the loop thread drives (the only thread that calls it but for `validate`)."""
        self._idle_wait_s = idle_wait_s
        self._heartbeat = getattr(engine, "heartbeat", None)
        self._heartbeat_s = heartbeat_s
        self._last_beat = time.monotonic()
        self._stats = engine.stats()
        self._description = engine.describe()
        self._start()

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
        stream: Inbox[TokenDelta] = Inbox()
        self._submit(request_id, stream, ("add", request_id, list(prompt_ids), params, adapter, images))
        finished = False
        try:
            while True:
                delta = await stream.get()
                finished = delta.finished
                yield delta
                if finished:
                    return
        finally:
            self._settled(request_id, stream)
            if not finished:
                self._queue.put(("abort", request_id))

    def validate(self, prompt_ids: list[int], params: SamplingParams, adapter: Optional[str] = None,
                 images: tuple = ()) -> None:
        """Raise InvalidRequestError if the engine could never serve this request (any thread)."""
        self.engine.validate(prompt_ids, params, adapter, *((images,) if images else ()))

    @property
    def image_layout(self) -> Optional[tuple[int, int]]:
        """(image placeholder token id, tokens per image) of a model that takes images, else None."""
        token = getattr(self.engine, "image_token_id", None)
        return None if token is None else (token, self.engine.images.tokens_per_image)

    def add_adapter(self, name: str, path: str) -> None:
        """Read a LoRA adapter and serve it as `name` (blocking; the engine's `add_adapter` is
        thread-safe). ValueError if the engine cannot serve it."""
        self.engine.add_adapter(name, path)

    def remove_adapter(self, name: str) -> bool:
        return self.engine.remove_adapter(name)

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with a delta whose finish reason is `abort`."""
        self._queue.put(("abort", request_id))

    def stats(self) -> EngineStats:
        """The snapshot taken after the most recent step (cheap; no lock on the engine)."""
        return self._stats

    def describe(self) -> dict[str, str]:
        return self._description

    # ---- loop thread ----

    def _work(self) -> None:
        self._drain_commands(block=not self.engine.has_work())
        if not self.engine.has_work():
            self._beat()
        deltas = self._step() if self.engine.has_work() else []
        self._stats = self.engine.stats()  # before delivery: a finished stream sees its pages freed
        if self._error is None:  # the watchdog may have failed the streams while the step ran
            self._deliver(deltas)

    def _beat(self) -> None:
        """An idle engine's heartbeat, every `heartbeat_s`: it still finds out that it lost a host."""
        if self._heartbeat is not None and time.monotonic() - self._last_beat > self._heartbeat_s:
            self._heartbeat()
            self._last_beat = time.monotonic()

    def _wind_down(self) -> None:
        """On shutdown: abort every request and step until the engine holds none (aborted requests
        leave with their last delta), so every KV page is free when the loop ends."""
        for request_id in self._keys():
            self.engine.abort(request_id)
        while self.engine.has_work():
            self._step()
        self._stats = self.engine.stats()

    def _step(self) -> list[TokenDelta]:
        return self._call(self.engine.step)

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._queue.get(timeout=self._idle_wait_s) if block else self._queue.get_nowait()
        except queue.Empty:
            return
        while True:
            if command is not None:  # None: woken to stop
                self._apply(command)
            try:
                command = self._queue.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt_ids, params, adapter, images = command
            [stream] = self._inboxes([request_id])
            if stream is None:  # the caller gave up before the loop saw the request
                return
            try:
                self.engine.add_request(request_id, prompt_ids, params, adapter, *((images,) if images else ()))
            except InvalidRequestError as exc:
                stream.put(exc)
        elif kind == "abort":
            self.engine.abort(command[1])

    def _deliver(self, deltas: list[TokenDelta]) -> None:
        streams = self._inboxes(d.request_id for d in deltas)
        for stream, delta in zip(streams, deltas):
            if stream is not None and stream.put(delta):
                continue
            if stream is not None:  # its event loop closed under it
                self._settled(delta.request_id, stream)
            if not delta.finished:  # nobody listens any more
                self.engine.abort(delta.request_id)
