"""/v1/embeddings."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from serve_app.http.backends import ModelBackend
from serve_app.http.dispatch import json_response, serve_request
from serve_app.http.schema import json_body, ok
from serve_app.protocol.context import RequestContext
from serve_app.protocol.embeddings import EmbeddingRequest, EmbeddingResponse

router = APIRouter(prefix="/v1")


@router.post("/embeddings", openapi_extra=json_body(EmbeddingRequest), responses=ok(EmbeddingResponse, streams=False))
async def embeddings(raw: Request) -> Response:
    return await serve_request(raw, EmbeddingRequest, _embed)


async def _embed(backend: ModelBackend, request: EmbeddingRequest, context: RequestContext) -> Response:
    return json_response(await backend.call("embed", request, context.arrival_time))
