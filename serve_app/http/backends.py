"""How the ingress reaches the model servers of one model: a `ModelBackend`.

In Ray Serve each backend is a `HandleBackend` over the model's deployment handle (streams go
through `.options(stream=True)`; a request for a LoRA adapter sets `multiplexed_model_id`, so the
router prefers the replicas that hold it); a `LocalBackend` calls a replica in the same process
(tests, a single-process server). The app builder describes each model to the ingress as one
`ServedModel`.

Invariant: a client that goes away closes its backend stream, which cancels the Ray call and so
aborts its engine requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator, Optional, Protocol

from pydantic import BaseModel
from ray.serve.handle import DeploymentHandle

from serve_app.errors import Unavailable
from serve_app.http.model_states import READY, ModelState, ModelStates
from serve_app.protocol.context import LoraRef, RequestContext
from serve_app.tasks import DEFAULT_TASK

BROADCAST_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """One model as the app builder hands it to the ingress."""

    handle: DeploymentHandle
    """Its model servers' deployment (the builder passes the bound deployment; Serve hands the
    ingress its handle)."""
    task: str = DEFAULT_TASK
    """What it serves (serve_app.tasks)."""
    root: Optional[str] = None
    """Where the model came from (engine.config.ModelSource.describe)."""
    silence_timeout_s: Optional[float] = None
    """How long a stream may send nothing, not even a keepalive, before the ingress ends it."""
    lora_modules: dict[str, str] = dataclasses.field(default_factory=dict)
    """Its LoRA adapters served from the start, by name."""


class ModelBackend(Protocol):
    """How the ingress reaches the servers of one model."""

    task: str
    """What the model serves (serve_app.tasks: which routes take its requests)."""
    root: Optional[str]
    """Where the model came from (engine.config.ModelSource.describe), if known."""

    def stream(self, request: BaseModel, context: RequestContext) -> AsyncIterator[list[str]]: ...

    async def respond(self, request: BaseModel, context: RequestContext) -> str: ...

    async def call(self, method: str, *args: Any, lora: Optional[LoraRef] = None) -> str:
        """The answer of the servers' `method` (embed, transcribe, tokenize, detokenize,
        load_adapter); with `lora`, from a replica that holds that adapter if one does."""

    async def state(self) -> ModelState:
        """Whether the model can take a request now: ready, starting or failed to start (and why)."""

    async def statuses(self) -> list[Any]:
        """One `Replica.status()` per live replica (an exception for one that did not answer)."""

    async def metric_families(self) -> list[list]:
        """One `Replica.metric_families()` per live replica."""


class HandleBackend:
    """A model's servers behind a Ray Serve deployment handle. A stream whose replica sends nothing,
    not even its keepalive (an empty batch, dropped here), for `silence_timeout_s` fails with a 503:
    a frozen or lost replica never leaves a client waiting."""

    def __init__(self, model_id: str, model: ServedModel, states: ModelStates):
        self.task, self.root = model.task, model.root
        self._states, self._model_id = states, model_id
        self._handle = model.handle
        self._streaming = model.handle.options(stream=True)
        self._silence_timeout_s = model.silence_timeout_s

    async def stream(self, request: BaseModel, context: RequestContext) -> AsyncIterator[list[str]]:
        lora = context.lora
        streaming = self._streaming if lora is None else self._streaming.options(multiplexed_model_id=lora.key)
        response = streaming.stream_chunks.remote(request, context)
        finished = False
        try:
            while True:
                # asyncio.wait, not wait_for: a call to a frozen replica may not even finish cancelling
                next_batch = asyncio.ensure_future(anext(response))
                done, _ = await asyncio.wait({next_batch}, timeout=self._silence_timeout_s)
                if not done:
                    next_batch.cancel()
                    finished = True  # cancel without waiting on a replica that may be frozen
                    asyncio.get_running_loop().run_in_executor(None, response.cancel)
                    raise Unavailable(f"the model server sent nothing for {self._silence_timeout_s:g} s, not even a "
                                      "keepalive: it is stuck or gone; retry")
                try:
                    batch = next_batch.result()
                except StopAsyncIteration:
                    break
                if batch:
                    yield batch
            finished = True
        finally:
            if not finished:  # closes the server's generator, which aborts its engine requests
                response.cancel()

    async def respond(self, request: BaseModel, context: RequestContext) -> str:
        return await self.call("respond", request, context, lora=context.lora)

    async def call(self, method: str, *args: Any, lora: Optional[LoraRef] = None) -> str:
        handle = self._handle if lora is None else self._handle.options(multiplexed_model_id=lora.key)
        response = getattr(handle, method).remote(*args)
        try:
            return await response
        except asyncio.CancelledError:
            response.cancel()
            raise

    async def state(self) -> ModelState:
        return await self._states.get(self._model_id)

    async def statuses(self) -> list[Any]:
        return await self._broadcast("status")

    async def metric_families(self) -> list[list]:
        return [r for r in await self._broadcast("metric_families") if isinstance(r, list)]

    async def _broadcast(self, method: str) -> list[Any]:
        """Every live replica's answer, or the exception in its place."""
        call = self._handle.broadcast(method)
        try:
            return await call.results_async(timeout_s=BROADCAST_TIMEOUT_S, return_exceptions=True)
        except TimeoutError as exc:
            return [exc]


class LocalBackend:
    """A replica (serve_app.replicas) in this process."""

    def __init__(self, server: Any):
        self.server = server
        self.task = getattr(server, "task", DEFAULT_TASK)
        self.root = getattr(server, "root", None)

    def stream(self, request: BaseModel, context: RequestContext) -> AsyncIterator[list[str]]:
        return self.server.stream_chunks(request, context)

    async def respond(self, request: BaseModel, context: RequestContext) -> str:
        return await self.server.respond(request, context)

    async def call(self, method: str, *args: Any, lora: Optional[LoraRef] = None) -> str:
        answer = getattr(self.server, method)(*args)
        return await answer if asyncio.iscoroutine(answer) else answer

    async def state(self) -> ModelState:
        return READY  # the server exists, so it started

    async def statuses(self) -> list[Any]:
        return [self.server.status()]

    async def metric_families(self) -> list[list]:
        return [self.server.metric_families()]
