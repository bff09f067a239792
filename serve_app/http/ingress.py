"""The ingress: OpenAI routes, API-key auth, model lookup and SSE framing, in front of model servers.

`create_app` builds the FastAPI app over one `ModelBackend` per served model. In Ray Serve each
backend is a `HandleBackend` (deployment handles; streams go through `.options(stream=True)`); a
`LocalBackend` calls a `ModelServer` in the same process (tests, a single-process server).

The app publishes its OpenAPI 3.1 document at /openapi.json (Swagger UI at /docs, ReDoc at /redoc;
no API key needed). The POST routes still parse their raw body with `parse_request`, so an invalid
body is our 400, never FastAPI's 422: their request bodies are only declared (`_json_body`), and
`_publish_schema` adds the request models' JSON schemas to the document's components.

Invariants: every error a client sees has OpenAI's error body, never a traceback; a request over
one of `RequestLimits` (serve_app.http.limits) never reaches a model server; a streamed request either fails
before its first byte (a real HTTP status) or ends with `data: [DONE]` (after an error event if
it failed mid-stream); a client that goes away closes its backend stream, which cancels the Ray
call and so aborts its engine requests.

LoRA adapters (serve_app.replicas.adapters): a request whose `model` names an adapter goes to its base model's
backend with the adapter's `LoraRef`; /v1/models lists adapters with their `parent`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import time
from typing import Any, AsyncIterator, Optional, Protocol

from fastapi import APIRouter, Depends, FastAPI, Request, Security
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, SecretStr
from pydantic.json_schema import models_json_schema
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from serve_app.config import CorsConfig, RequestLimits, TracingConfig
from serve_app.errors import (
    APIError,
    BadRequest,
    MethodNotAllowed,
    NotFound,
    RouteNotFound,
    Unauthorized,
    Unavailable,
    to_api_error,
)
from serve_app.http.adapter_routes import AdapterRoute, AdapterRoutes
from serve_app.http.limits import BodySizeLimit, check_limits
from serve_app.http.metrics import CountResponses, HttpResponses, render
from serve_app.http.model_states import READY, ModelState, ModelStates, serve_status
from serve_app.logs import replica_name, route_logs_to_replica_log
from serve_app.protocol.admin import (
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoraAdapterRequest,
)
from serve_app.protocol.audio import (
    AudioRequest,
    Transcription,
    TranscriptionRequest,
    TranscriptTextDelta,
    TranslationRequest,
    VerboseTranscription,
)
from serve_app.protocol.base import ErrorResponse, parse_form, parse_request
from serve_app.protocol.chat import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from serve_app.protocol.completions import CompletionRequest, CompletionResponse
from serve_app.protocol.context import LoraRef, RequestContext
from serve_app.protocol.embeddings import EmbeddingRequest, EmbeddingResponse
from serve_app.tracing import Tracing, headers_of, set_attributes, set_http_status

BROADCAST_TIMEOUT_S = 10.0
REF_TEMPLATE = "#/components/schemas/{model}"
SCHEMA_MODELS = (CompletionRequest, ChatCompletionRequest, EmbeddingRequest, TokenizeRequest, DetokenizeRequest,
                 LoadLoraAdapterRequest, UnloadLoraAdapterRequest, TranscriptionRequest, TranslationRequest,
                 Transcription, VerboseTranscription, ErrorResponse)
"""The POST routes' bodies and the error body: `_publish_schema` adds them to the components."""
BEARER = HTTPBearer(auto_error=False, description="the server's API key, as `Authorization: Bearer <key>`")
"""Declares the /v1 routes' security scheme in the schema when a key is set; it never refuses a
request (auto_error=False): `_authorizer` checks the key and answers with our 401s."""
ERROR_BODY = {"application/json": {"schema": {"$ref": REF_TEMPLATE.format(model="ErrorResponse")}}}
ERRORS = {"4XX": {"content": ERROR_BODY}, "5XX": {"content": ERROR_BODY}}
"""Every error has OpenAI's body (JSON, on /metrics too). Declaring 4XX also keeps FastAPI from
listing a 422 it never sends."""
HEALTHY = {"type": "object", "required": ["status", "models"], "properties": {
    "status": {"const": "ok"},
    "models": {"type": "object", "description": "Per model: its state, its live replicas and, once it compiles step "
               "programs ahead of use, the fewest any replica has compiled and how many there are (a replica "
               "serves from the first; the rest compile in the background). A 503 lists every model's state "
               "(ready, starting or failed, with the error) beside the error.",
               "additionalProperties": {"type": "object", "required": ["state"], "properties": {
                   "state": {"enum": ["ready", "starting", "failed"]}, "error": {"type": ["string", "null"]},
                   "replicas": {"type": "integer"}, "compiled_programs": {"type": "integer"},
                   "step_programs": {"type": "integer"}}}}}}


class ModelBackend(Protocol):
    """How the ingress reaches the servers of one model."""

    task: str
    """"generate" (completions, chat) or "embed" (embeddings)."""
    root: Optional[str]
    """Where the model came from (engine.formats.model_sources.ModelSource.describe), if known."""

    def stream(self, request: BaseModel, context: RequestContext) -> AsyncIterator[list[str]]: ...

    async def respond(self, request: BaseModel, context: RequestContext) -> str: ...

    async def call(self, method: str, *args: Any, lora: Optional[LoraRef] = None) -> str:
        """The JSON answer of the servers' `method` (embed, tokenize, detokenize, load_adapter);
        with `lora`, from a replica that holds that adapter if one does."""

    async def state(self) -> ModelState:
        """Whether the model can take a request now: ready, starting or failed to start (and why)."""

    async def statuses(self) -> list[Any]:
        """One `ModelServer.status()` per live replica (an exception for one that did not answer)."""

    async def metric_families(self) -> list[list]:
        """One `ModelServer.metric_families()` per live replica."""


class HandleBackend:
    """A model's servers behind a Ray Serve deployment handle. A stream whose replica sends nothing,
    not even its keepalive (an empty batch, dropped here), for `silence_timeout_s` fails with a 503:
    a frozen or lost replica never leaves a client waiting."""

    def __init__(self, handle: DeploymentHandle, states: ModelStates, model_id: str,
                 silence_timeout_s: Optional[float] = None, task: str = "generate", root: Optional[str] = None):
        self.task, self.root = task, root
        self._states, self._model_id = states, model_id
        self._handle = handle
        self._streaming = handle.options(stream=True)
        self._silence_timeout_s = silence_timeout_s

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
    """A `ModelServer` in this process."""

    def __init__(self, server: Any):
        self.server = server
        self.task = getattr(server, "task", "generate")
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


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


def create_app(
    backends: dict[str, ModelBackend],
    api_key: Optional[str] = None,
    limits: Optional[RequestLimits] = None,
    cors: Optional[CorsConfig] = None,
    adapters: Optional[dict[str, dict[str, str]]] = None,
    tracing: Tracing = Tracing.off(),
) -> FastAPI:
    """The OpenAI-compatible app. /v1 routes need `Authorization: Bearer <api_key>` when a key is
    set; /health, /metrics and the schema (/openapi.json, /docs, /redoc) never do. `limits` bound
    each request (defaults: RequestLimits()); `cors` answers browsers' CORS requests when it allows
    origins; `adapters`: each model's `lora_modules`; `tracing`: a span per request
    (serve_app.tracing)."""
    limits = limits if limits is not None else RequestLimits()
    routes = AdapterRoutes(adapters or {}, list(backends))
    app = FastAPI(title="jax-serve", summary="OpenAI-compatible LLM server on Ray Serve and JAX")
    _publish_schema(app)
    app.add_exception_handler(APIError, lambda _, exc: error_response(exc))
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, lambda _, exc: error_response(to_api_error(exc)))  # no traceback
    _add_middleware(app, limits, cors)
    responses = HttpResponses(replica_name())
    app.add_middleware(CountResponses, responses=responses)
    security = [Security(BEARER)] if api_key is not None else []
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_authorizer(api_key)), *security], responses=ERRORS)

    async def serve_request(raw: Request, request_cls: type[BaseModel]) -> Response:
        span = tracing.start(f"POST {raw.url.path}", dict(raw.headers), server=True,
                             **{"http.request.method": "POST", "http.route": raw.url.path})
        return _ending_span(await answer(raw, request_cls, span), span)

    async def answer(raw: Request, request_cls: type[BaseModel], span) -> Response:
        try:
            if request_cls in AUDIO_ROUTES:
                request = await read_audio_form(raw, request_cls)
            else:
                request = parse_request(request_cls, await raw.body())
            set_attributes(span, **{"gen_ai.request.model": request.model})
            check_limits(request, limits)
            route = routes.get(request.model)
            model_id, lora = (route.base, route.ref) if route else (request.model, None)
            backend = _backend(backends, model_id, request_cls, routes)
            problem = (await backend.state()).problem(model_id)
            if problem:  # starting or failed: say so now, rather than queue it behind replicas that are not there
                raise Unavailable(problem)
            if isinstance(request, EmbeddingRequest):
                return _json(await backend.call("embed", request, time.time()))
            if isinstance(request, AudioRequest) and not request.stream:
                body, media_type = await backend.call("transcribe", request, time.time())
                return Response(body, media_type=media_type)
            if isinstance(request, TokenizeRequest):
                return _json(await backend.call("tokenize", request))
            if isinstance(request, DetokenizeRequest):
                return _json(await backend.call("detokenize", request))
            return await _respond(backend, request, RequestContext(time.time(), lora, headers_of(span)))
        except Exception as exc:
            return error_response(to_api_error(exc))

    async def lora_request(raw: Request, request_cls: type[BaseModel], change) -> Response:
        try:
            return PlainTextResponse(await change(parse_request(request_cls, await raw.body())))
        except Exception as exc:
            return error_response(to_api_error(exc))

    async def load(request: LoadLoraAdapterRequest) -> str:
        """Read the adapter on one replica of its base model (refusing what the engine cannot
        serve), then route its name; the other replicas read it on first use."""
        base = _lora_base(backends, request.base_model_name)
        routes.check(request.lora_name, replace=request.load_inplace)
        ref = LoraRef(request.lora_name, request.lora_path)
        await backends[base].call("load_adapter", ref, lora=ref)
        routes.add(base, request.lora_name, request.lora_path, replace=True)
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    async def unload(request: UnloadLoraAdapterRequest) -> str:
        routes.remove(request.lora_name)
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."

    @v1.post("/completions", openapi_extra=_json_body(CompletionRequest), responses=_ok(CompletionResponse))
    async def completions(raw: Request) -> Response:
        return await serve_request(raw, CompletionRequest)

    @v1.post(
        "/chat/completions",
        openapi_extra=_json_body(ChatCompletionRequest),
        responses=_ok(ChatCompletionResponse, ChatCompletionChunk),
    )
    async def chat_completions(raw: Request) -> Response:
        return await serve_request(raw, ChatCompletionRequest)

    @v1.post("/audio/transcriptions", openapi_extra=_form_body(TranscriptionRequest),
             responses=_audio_ok(TranscriptTextDelta))
    async def audio_transcriptions(raw: Request) -> Response:
        return await serve_request(raw, TranscriptionRequest)

    @v1.post("/audio/translations", openapi_extra=_form_body(TranslationRequest), responses=_audio_ok())
    async def audio_translations(raw: Request) -> Response:
        return await serve_request(raw, TranslationRequest)

    @v1.post("/embeddings", openapi_extra=_json_body(EmbeddingRequest), responses=_ok(EmbeddingResponse, streams=False))
    async def embeddings(raw: Request) -> Response:
        return await serve_request(raw, EmbeddingRequest)

    @v1.post("/load_lora_adapter", openapi_extra=_json_body(LoadLoraAdapterRequest), response_class=PlainTextResponse)
    async def load_lora_adapter(raw: Request) -> Response:
        return await lora_request(raw, LoadLoraAdapterRequest, load)

    @v1.post("/unload_lora_adapter", openapi_extra=_json_body(UnloadLoraAdapterRequest),
             response_class=PlainTextResponse)
    async def unload_lora_adapter(raw: Request) -> Response:
        return await lora_request(raw, UnloadLoraAdapterRequest, unload)

    @v1.get("/models")
    async def models() -> ModelList:
        cards = [await _card(model_id, b) for model_id, b in backends.items()]
        return ModelList(data=cards + [await _adapter_card(r, backends[r.base]) for r in routes.routes()])

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        route = routes.get(model_id)
        if route is not None:
            return await _adapter_card(route, backends[route.base])
        if model_id not in backends:
            raise _unknown_model(model_id, backends, routes)
        return await _card(model_id, backends[model_id])

    # vLLM's token utilities, next to /v1 (behind the same key)
    utilities = APIRouter(dependencies=[Depends(_authorizer(api_key)), *security], responses=ERRORS)

    @utilities.post("/tokenize", openapi_extra=_json_body(TokenizeRequest), responses=_ok(TokenizeResponse, streams=False))
    async def tokenize(raw: Request) -> Response:
        return await serve_request(raw, TokenizeRequest)

    @utilities.post("/detokenize", openapi_extra=_json_body(DetokenizeRequest), responses=_ok(DetokenizeResponse, streams=False))
    async def detokenize(raw: Request) -> Response:
        return await serve_request(raw, DetokenizeRequest)

    @app.get("/health", responses={200: {"content": {"application/json": {"schema": HEALTHY}}}, **ERRORS})
    async def health() -> Response:
        models, problems = {}, []
        for model_id, backend in backends.items():
            state = await backend.state()
            if state.state != "ready":
                problems.append(state.problem(model_id))
                models[model_id] = {"state": state.state, "error": state.reason}
                continue
            statuses = await backend.statuses()
            problem = _readiness_problem(statuses)
            if problem:
                problems.append(f"model {model_id!r} is not ready: {problem}")
                models[model_id] = {"state": "starting", "error": problem}
                continue
            models[model_id] = {"state": "ready", **_model_health(statuses)}
        if problems:
            error = Unavailable("; ".join(problems))
            return JSONResponse({**error.body(), "models": models}, status_code=error.status, headers=error.headers())
        return JSONResponse({"status": "ok", "models": models})

    @app.get("/metrics", response_class=PlainTextResponse, responses=ERRORS)  # Prometheus' text format
    async def metrics() -> Response:
        families = [f for backend in backends.values() for f in await backend.metric_families()]
        return Response(render([*families, responses.families()]), media_type=CONTENT_TYPE_LATEST)

    app.include_router(v1)
    app.include_router(utilities)
    return app


ROUTE_TASKS = {CompletionRequest: "generate", ChatCompletionRequest: "generate", EmbeddingRequest: "embed",
               TranscriptionRequest: "transcribe", TranslationRequest: "transcribe"}
TASK_ROUTES = {"generate": ("a text generation model", "/v1/completions or /v1/chat/completions"),
               "embed": ("an embedding model", "/v1/embeddings"),
               "transcribe": ("a speech-to-text model", "/v1/audio/transcriptions or /v1/audio/translations")}
"""What each task's model is called in an error, and where its requests go."""
AUDIO_ROUTES = (TranscriptionRequest, TranslationRequest)
MAX_FORM_FIELDS = 32
"""Fields a multipart form may carry besides its file (an OpenAI client sends at most ~10)."""


async def read_audio_form(raw: Request, request_cls: type[BaseModel]) -> AudioRequest:
    """The `AudioRequest` of a multipart form: one `file` part and `request_cls`'s fields (array
    fields may be sent as `name[]`, as the OpenAI clients do)."""
    if not raw.headers.get("content-type", "").startswith("multipart/form-data"):
        raise BadRequest("send the audio as multipart/form-data with the file in the field 'file' (as the OpenAI "
                         "clients do)", "file")
    try:
        form = await raw.form(max_files=1, max_fields=MAX_FORM_FIELDS)
    except HTTPException as exc:  # starlette's refusal of a malformed or oversized form
        raise BadRequest(f"the multipart form cannot be read: {exc.detail}", "file") from None
    try:
        fields: dict[str, Any] = {}
        upload = None
        for name, value in form.multi_items():
            if name == "file":
                upload = value
            elif name.endswith("[]") or name == "timestamp_granularities":
                fields.setdefault(name.removesuffix("[]"), []).append(value)
            elif isinstance(value, str):
                fields[name] = value
            else:
                raise BadRequest(f"the form field {name!r} holds a file; only 'file' may", name)
        if upload is None or isinstance(upload, str):
            raise BadRequest("the form has no audio file; send it in the field 'file'", "file")
        params = parse_form(request_cls, fields)
        return AudioRequest(params, await upload.read())
    finally:
        await form.close()


async def _card(model_id: str, backend: ModelBackend) -> ModelCard:
    state = await backend.state()
    return ModelCard(id=model_id, root=backend.root, task=backend.task, state=state.state, error=state.reason)


async def _adapter_card(route: AdapterRoute, backend: ModelBackend) -> ModelCard:
    state = await backend.state()
    return ModelCard(id=route.ref.name, root=route.ref.path, parent=route.base, task="generate", state=state.state,
                     error=state.reason)


def _lora_base(backends: dict[str, ModelBackend], name: Optional[str]) -> str:
    """The model a loaded adapter adapts: `name`, or the only text generation model."""
    generating = sorted(model_id for model_id, b in backends.items() if b.task == "generate")
    if name is None and len(generating) == 1:
        return generating[0]
    if name is None:
        raise BadRequest(f"this server serves several text generation models ({', '.join(generating)}); say which "
                         "the adapter adapts in base_model_name", "base_model_name")
    if name not in generating:
        raise BadRequest(f"base_model_name {name!r} is not a text generation model served here; served: "
                         f"{', '.join(generating)}", "base_model_name")
    return name


def _backend(backends: dict[str, ModelBackend], model_id: str, request_cls: type[BaseModel],
             routes: Optional[AdapterRoutes] = None) -> ModelBackend:
    """The backend of `model_id`, if it serves requests of this kind (else a 404 or a 400)."""
    if model_id not in backends:
        raise _unknown_model(model_id, backends, routes)
    backend, task = backends[model_id], ROUTE_TASKS.get(request_cls)
    if task is not None and backend.task != task:
        what, route = TASK_ROUTES[backend.task]
        raise BadRequest(f"model {model_id!r} is {what}; send this request to {route}", "model")
    return backend


def _json(body: str) -> Response:
    return Response(body, media_type="application/json")


def _publish_schema(app: FastAPI) -> None:
    """Make `app.openapi()` FastAPI's document plus the JSON schemas of `SCHEMA_MODELS` and their
    nested models in components/schemas, so that every `$ref` of `_json_body` and `ERRORS` resolves."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:  # built once, on the first request for it
            _add_components(FastAPI.openapi(app), SCHEMA_MODELS)
        return app.openapi_schema

    app.openapi = openapi


def _add_components(document: dict[str, Any], models: tuple[type[BaseModel], ...]) -> None:
    _, schemas = models_json_schema([(m, "validation") for m in models], ref_template=REF_TEMPLATE)
    components = document.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in schemas["$defs"].items():
        if components.setdefault(name, schema) != schema:  # two different models under one name
            raise ValueError(f"two OpenAPI schemas named {name!r}")


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """An operation's requestBody, declared only: the route validates the raw body itself."""
    schema = {"$ref": REF_TEMPLATE.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _form_body(model: type[BaseModel]) -> dict[str, Any]:
    """An audio route's requestBody, declared only: a multipart form of `model`'s fields and the file."""
    schema = {"allOf": [{"$ref": REF_TEMPLATE.format(model=model.__name__)},
                        {"type": "object", "required": ["file"], "properties": {
                            "file": {"type": "string", "format": "binary",
                                     "description": "The audio: wav, flac, mp3, ogg/opus, webm, m4a, ..."}}}]}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}


def _audio_ok(chunk: Optional[type[BaseModel]] = None) -> dict[Any, Any]:
    """An audio route's 200: JSON (json, verbose_json), text (text, srt, vtt) or, with `chunk`, events."""
    content: dict[str, Any] = {
        "application/json": {"schema": {"anyOf": [{"$ref": REF_TEMPLATE.format(model=m.__name__)}
                                                  for m in (Transcription, VerboseTranscription)]}},
        "text/plain": {"schema": {"type": "string"}}}
    if chunk is not None:
        content["text/event-stream"] = {"schema": {"type": "string", "description": f"data: <{chunk.__name__} or "
                                                   "TranscriptTextDone JSON> events, then data: [DONE]"}}
    return {200: {"content": content}}


def _ok(model: type[BaseModel], chunk: Optional[type[BaseModel]] = None, streams: bool = True) -> dict[Any, Any]:
    """The 200 of a POST route: `model` as JSON, or (where it `streams`) with `stream: true`
    server-sent events, each `data: <chunk>` (a `chunk`, by default `model` again), then `data: [DONE]`."""
    if not streams:
        return {200: {"model": model}}
    events = {"type": "string", "description": f"data: <{(chunk or model).__name__} JSON> events, then data: [DONE]"}
    return {200: {"model": model, "content": {"text/event-stream": {"schema": events}}}}


def _add_middleware(app: FastAPI, limits: RequestLimits, cors: Optional[CorsConfig]) -> None:
    """The body size limit, inside CORS (the last added runs first), so that browsers can read
    a 413 too."""
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_body_bytes)
    if cors is not None and cors.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=cors.allowed_origins,
            allow_methods=cors.allowed_methods,
            allow_headers=cors.allowed_headers,
            allow_credentials=False,
            expose_headers=["Retry-After"],
        )


def _ending_span(response: Response, span) -> Response:
    """`response`, ending `span` with its status once it is sent (a stream: after its last byte)."""
    if span is None:
        return response
    set_http_status(span, response.status_code)
    if not isinstance(response, StreamingResponse):
        span.end()
        return response
    body = response.body_iterator

    async def ending() -> AsyncIterator:
        try:
            async with contextlib.aclosing(body):
                async for part in body:
                    yield part
        finally:
            span.end()

    response.body_iterator = ending()
    return response


async def _respond(backend: ModelBackend, request: Any, context: RequestContext) -> Response:
    if not request.stream:
        return Response(await backend.respond(request, context), media_type="application/json")
    chunks = backend.stream(request, context)
    try:  # errors before the first chunk (bad prompt, full queue) get their own HTTP status
        first = await anext(chunks)
    except StopAsyncIteration:
        first = []
    return StreamingResponse(_sse(first, chunks), media_type="text/event-stream")


async def _sse(first: list[str], chunks: AsyncIterator[list[str]]) -> AsyncIterator[str]:
    async with contextlib.aclosing(chunks):
        try:
            yield _frames(first)
            async for batch in chunks:
                yield _frames(batch)
        except Exception as exc:
            yield _frames([json.dumps(to_api_error(exc).body())])
        yield "data: [DONE]\n\n"


def _frames(chunks: list[str]) -> str:
    return "".join(f"data: {chunk}\n\n" for chunk in chunks)


def _authorizer(api_key: Optional[str]):
    async def authorize(raw: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = raw.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("no API key provided; send it as 'Authorization: Bearer <key>'")
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise Unauthorized("incorrect API key provided")

    return authorize


def _unknown_model(model_id: str, backends: dict[str, ModelBackend],
                   routes: Optional[AdapterRoutes] = None) -> NotFound:
    adapters = sorted(r.ref.name for r in routes.routes()) if routes is not None else []
    also = f"; LoRA adapters: {adapters}" if adapters else ""
    return NotFound(f"the model {model_id!r} does not exist; served models: {sorted(backends)}{also}", "model")


def _model_health(statuses: list[Any]) -> dict[str, int]:
    """/health's entry for a ready model: its live replicas and, while they still compile step
    programs in the background, the fewest any has compiled and how many there are."""
    alive = [s for s in statuses if isinstance(s, dict) and s["alive"]]
    health = {"replicas": len(alive)}
    total = max(s.get("step_programs", 0) for s in alive)  # .get: a replica of an older version (rolling update)
    if total:
        health.update(compiled_programs=min(s.get("compiled_programs", 0) for s in alive), step_programs=total)
    return health


def _readiness_problem(statuses: list[Any]) -> Optional[str]:
    """None when at least one replica is alive, else why not."""
    if any(isinstance(s, dict) and s["alive"] for s in statuses):
        return None
    if not statuses:
        return "no model server replica is running yet (loading and warming up)"
    return "; ".join(str(s["error"]) if isinstance(s, dict) else repr(s) for s in statuses)


async def _http_error(raw: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (unknown route, wrong method) in OpenAI's shape."""
    route = f"{raw.method} {raw.url.path}"
    if exc.status_code == 404:
        return error_response(RouteNotFound(f"no route {route}"))
    if exc.status_code == 405:
        return error_response(MethodNotAllowed(f"method not allowed: {route}"))
    return error_response(BadRequest(f"{exc.detail} ({route})"))


@serve.ingress()
class Ingress:
    """The Ray Serve ingress deployment; its FastAPI app is built on each replica from handles."""

    def __init__(
        self,
        api_key: Optional[SecretStr],
        servers: dict[str, DeploymentHandle],
        limits: Optional[RequestLimits] = None,
        cors: Optional[CorsConfig] = None,
        silence_timeouts_s: Optional[dict[str, float]] = None,
        tasks: Optional[dict[str, str]] = None,
        roots: Optional[dict[str, str]] = None,
        adapters: Optional[dict[str, dict[str, str]]] = None,
        tracing: Optional[TracingConfig] = None,
    ):
        route_logs_to_replica_log()  # a model that fails to start is logged here, once
        key = api_key.get_secret_value() if api_key is not None else None
        silence, tasks, roots = silence_timeouts_s or {}, tasks or {}, roots or {}
        app_name = serve.get_replica_context().app_name
        states = ModelStates({model_id: h.deployment_name for model_id, h in servers.items()},
                             functools.partial(serve_status, app_name))
        backends = {model_id: HandleBackend(h, states, model_id, silence.get(model_id), tasks.get(model_id, "generate"),
                                            roots.get(model_id)) for model_id, h in servers.items()}
        traces = Tracing.to_endpoint(tracing.otlp_traces_endpoint if tracing else None, "jax-serve-ingress")
        self._app = create_app(backends, key, limits, cors, adapters, traces)

        watcher: list[asyncio.Task] = []  # held: a task nobody references may be collected

        async def watch() -> None:  # on the app's loop, from its start to its shutdown
            watcher.append(asyncio.create_task(states.watch()))

        async def stop_watching() -> None:
            for task in watcher:
                task.cancel()

        self._app.router.on_startup.append(watch)
        self._app.router.on_shutdown.append(stop_watching)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app
