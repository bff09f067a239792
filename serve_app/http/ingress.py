"""The ingress: OpenAI routes, API-key auth, model lookup and SSE framing, in front of model servers.

`create_app` builds the FastAPI app over one `ModelBackend` per served model
(serve_app.http.backends) and mounts one router per route family (serve_app.http.routes); every
model request takes the same path through it (serve_app.http.dispatch). The `Ingress` deployment
builds that app on each ingress replica from the `ServedModel`s the app builder hands it.

The app publishes its OpenAPI 3.1 document at /openapi.json (serve_app.http.schema; Swagger UI at
/docs, ReDoc at /redoc; no API key needed).

Invariants: every error a client sees has OpenAI's error body, never a traceback; the ingress
imports neither jax nor transformers, nor any replica's module.

LoRA adapters (serve_app.replicas.adapters): a request whose `model` names an adapter goes to its base model's
backend with the adapter's `LoraRef`; /v1/models lists adapters with their `parent`.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
from typing import Optional

from fastapi import Depends, FastAPI, Request, Security
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from fastapi.security import HTTPBearer
from pydantic import SecretStr
from ray import serve
from starlette.exceptions import HTTPException

from serve_app.config import CorsConfig, RequestLimits, TracingConfig
from serve_app.errors import APIError, BadRequest, MethodNotAllowed, RouteNotFound, Unauthorized, to_api_error
from serve_app.http.adapter_routes import AdapterRoutes
from serve_app.http.backends import HandleBackend, ModelBackend, ServedModel
from serve_app.http.dispatch import error_response
from serve_app.http.limits import BodySizeLimit
from serve_app.http.metrics import CountResponses, HttpResponses
from serve_app.http.model_states import ModelStates, serve_status
from serve_app.http.routes import audio, completions, embeddings, health, lora, models, score, tokens
from serve_app.http.schema import ERRORS, publish_schema
from serve_app.http.served import Served
from serve_app.logs import replica_name, route_logs_to_replica_log
from serve_app.tracing import Tracing

BEARER = HTTPBearer(auto_error=False, description="the server's API key, as `Authorization: Bearer <key>`")
"""Declares the /v1 routes' security scheme in the schema when a key is set; it never refuses a
request (auto_error=False): `_authorizer` checks the key and answers with our 401s."""
KEYED_ROUTES = (completions.router, audio.router, embeddings.router, score.router, lora.router, models.router,
                tokens.router)
"""The route families behind the API key (all but health and metrics), in the order the schema lists them."""


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
    app = FastAPI(title="jax-serve", summary="OpenAI-compatible LLM server on Ray Serve and JAX")
    app.state.served = Served(backends, AdapterRoutes(adapters or {}, list(backends)), limits, tracing,
                              HttpResponses(replica_name()))
    publish_schema(app)
    app.add_exception_handler(APIError, lambda _, exc: error_response(exc))
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, lambda _, exc: error_response(to_api_error(exc)))  # no traceback
    _add_middleware(app, limits, cors)
    app.add_middleware(CountResponses, responses=app.state.served.responses)
    keyed = [Depends(_authorizer(api_key)), *([Security(BEARER)] if api_key is not None else [])]
    app.include_router(health.router)
    for router in KEYED_ROUTES:
        app.include_router(router, dependencies=keyed, responses=ERRORS)
    return app


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
    """The Ray Serve ingress deployment; its FastAPI app is built on each replica from the models'
    handles."""

    def __init__(
        self,
        api_key: Optional[SecretStr],
        models: dict[str, ServedModel],
        limits: Optional[RequestLimits] = None,
        cors: Optional[CorsConfig] = None,
        tracing: Optional[TracingConfig] = None,
    ):
        route_logs_to_replica_log()  # a model that fails to start is logged here, once
        key = api_key.get_secret_value() if api_key is not None else None
        app_name = serve.get_replica_context().app_name
        states = ModelStates({model_id: m.handle.deployment_name for model_id, m in models.items()},
                             functools.partial(serve_status, app_name))
        backends = {model_id: HandleBackend(model_id, m, states) for model_id, m in models.items()}
        adapters = {model_id: m.lora_modules for model_id, m in models.items() if m.lora_modules}
        traces = Tracing.to_endpoint(tracing.otlp_traces_endpoint if tracing else None, "jax-serve-ingress")
        self._app = create_app(backends, key, limits, cors, adapters, traces)
        _watch_while_serving(self._app, states)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app


def _watch_while_serving(app: FastAPI, states: ModelStates) -> None:
    """Keep `states` fresh on the app's loop, from its start to its shutdown."""
    watcher: list[asyncio.Task] = []  # held: a task nobody references may be collected

    async def watch() -> None:
        watcher.append(asyncio.create_task(states.watch()))

    async def stop_watching() -> None:
        for task in watcher:
            task.cancel()

    app.router.on_startup.append(watch)
    app.router.on_shutdown.append(stop_watching)
