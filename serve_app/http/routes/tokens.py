"""vLLM's token utilities, /tokenize and /detokenize, next to /v1 (behind the same key): any
model's tokenizer, whatever its task."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from serve_app.http.backends import ModelBackend
from serve_app.http.dispatch import json_response, serve_request
from serve_app.http.schema import json_body, ok
from serve_app.protocol.admin import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from serve_app.protocol.context import RequestContext

router = APIRouter()


@router.post("/tokenize", openapi_extra=json_body(TokenizeRequest), responses=ok(TokenizeResponse, streams=False))
async def tokenize(raw: Request) -> Response:
    return await serve_request(raw, TokenizeRequest, _call("tokenize"))


@router.post("/detokenize", openapi_extra=json_body(DetokenizeRequest),
             responses=ok(DetokenizeResponse, streams=False))
async def detokenize(raw: Request) -> Response:
    return await serve_request(raw, DetokenizeRequest, _call("detokenize"))


def _call(method: str):
    """The answer of the backend's servers' `method` to the request, as JSON."""

    async def call(backend: ModelBackend, request, context: RequestContext) -> Response:
        return json_response(await backend.call(method, request))

    return call
