"""/v1/rerank and /v1/score."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from serve_app.http.backends import ModelBackend
from serve_app.http.dispatch import json_response, serve_request
from serve_app.http.schema import json_body, ok
from serve_app.protocol.context import RequestContext
from serve_app.protocol.score import RerankRequest, RerankResponse, ScoreRequest, ScoreResponse

router = APIRouter(prefix="/v1")


@router.post("/rerank", openapi_extra=json_body(RerankRequest), responses=ok(RerankResponse, streams=False))
async def rerank(raw: Request) -> Response:
    return await serve_request(raw, RerankRequest, _rerank)


@router.post("/score", openapi_extra=json_body(ScoreRequest), responses=ok(ScoreResponse, streams=False))
async def score(raw: Request) -> Response:
    return await serve_request(raw, ScoreRequest, _score)


async def _rerank(backend: ModelBackend, request: RerankRequest, context: RequestContext) -> Response:
    return json_response(await backend.call("rerank", request, context.arrival_time))


async def _score(backend: ModelBackend, request: ScoreRequest, context: RequestContext) -> Response:
    return json_response(await backend.call("score", request, context.arrival_time))
