"""The path of every model request through the ingress, whatever its route: a span, the body
parsed, the limits checked, the model (or LoRA adapter) looked up, its state checked, then the
route's own call to the model's backend (`Answer`).

Invariants: every error a client sees has OpenAI's error body, never a traceback; a request over
one of `RequestLimits` (serve_app.http.limits) never reaches a model server; a streamed request
either fails before its first byte (a real HTTP status) or ends with `data: [DONE]` (after an
error event if it failed mid-stream).
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from serve_app.errors import APIError, Unavailable, to_api_error
from serve_app.http.backends import ModelBackend
from serve_app.http.limits import check_limits
from serve_app.http.served import served
from serve_app.protocol.base import parse_request
from serve_app.protocol.context import RequestContext
from serve_app.tracing import headers_of, set_attributes, set_http_status

Answer = Callable[[ModelBackend, Any, RequestContext], Awaitable[Response]]
"""A route's call to the backend of a request's model."""
Read = Callable[[Request, type[BaseModel]], Awaitable[Any]]
"""How a route reads its request (default: a JSON body)."""


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


async def answered(work: Awaitable[Response]) -> Response:
    """`work`'s response, or the error response of what it raised."""
    try:
        return await work
    except Exception as exc:
        return error_response(to_api_error(exc))


async def read_json(raw: Request, request_cls: type[BaseModel]) -> BaseModel:
    return parse_request(request_cls, await raw.body())


async def serve_request(raw: Request, request_cls: type[BaseModel], answer: Answer, read: Read = read_json) -> Response:
    """The response to a model request, in its span (ended once the response is sent)."""
    span = served(raw).tracing.start(f"POST {raw.url.path}", dict(raw.headers), server=True,
                                     **{"http.request.method": "POST", "http.route": raw.url.path})
    return _ending_span(await answered(_answer(raw, request_cls, answer, read, span)), span)


async def _answer(raw: Request, request_cls: type[BaseModel], answer: Answer, read: Read, span) -> Response:
    models = served(raw)
    request = await read(raw, request_cls)
    set_attributes(span, **{"gen_ai.request.model": request.model})
    check_limits(request, models.limits)
    model_id, lora = models.resolve(request.model)
    backend = models.backend(model_id, request_cls)
    problem = (await backend.state()).problem(model_id)
    if problem:  # starting or failed: say so now, rather than queue it behind replicas that are not there
        raise Unavailable(problem)
    return await answer(backend, request, RequestContext(time.time(), lora, headers_of(span)))


async def respond(backend: ModelBackend, request: Any, context: RequestContext) -> Response:
    """The response as one JSON body, or with `stream: true` as server-sent events."""
    if not request.stream:
        return Response(await backend.respond(request, context), media_type="application/json")
    chunks = backend.stream(request, context)
    try:  # errors before the first chunk (bad prompt, full queue) get their own HTTP status
        first = await anext(chunks)
    except StopAsyncIteration:
        first = []
    return StreamingResponse(_sse(first, chunks), media_type="text/event-stream")


def json_response(body: str) -> Response:
    """A backend's JSON answer, as it is."""
    return Response(body, media_type="application/json")


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
