"""/v1/completions and /v1/chat/completions: text generation, whole or streamed."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from serve_app.http.dispatch import respond, serve_request
from serve_app.http.schema import json_body, ok
from serve_app.protocol.chat import ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse
from serve_app.protocol.completions import CompletionRequest, CompletionResponse

router = APIRouter(prefix="/v1")


@router.post("/completions", openapi_extra=json_body(CompletionRequest), responses=ok(CompletionResponse))
async def completions(raw: Request) -> Response:
    return await serve_request(raw, CompletionRequest, respond)


@router.post(
    "/chat/completions",
    openapi_extra=json_body(ChatCompletionRequest),
    responses=ok(ChatCompletionResponse, ChatCompletionChunk),
)
async def chat_completions(raw: Request) -> Response:
    return await serve_request(raw, ChatCompletionRequest, respond)
