"""The ingress's OpenAPI 3.1 document (/openapi.json; Swagger UI at /docs, ReDoc at /redoc).

The POST routes parse their raw body themselves (`parse_request`), so that an invalid body is our
400, never FastAPI's 422: their request bodies are only declared (`json_body`, `form_body`), and
`publish_schema` adds the request models' JSON schemas to the document's components, so that every
`$ref` resolves.
"""

from __future__ import annotations

from typing import Any, Optional

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from serve_app.protocol.admin import (
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from serve_app.protocol.audio import (
    Transcription,
    TranscriptionRequest,
    TranslationRequest,
    VerboseTranscription,
)
from serve_app.protocol.base import ErrorResponse
from serve_app.protocol.chat import ChatCompletionRequest
from serve_app.protocol.completions import CompletionRequest
from serve_app.protocol.embeddings import EmbeddingRequest
from serve_app.protocol.score import RerankRequest, ScoreRequest

REF_TEMPLATE = "#/components/schemas/{model}"
SCHEMA_MODELS = (CompletionRequest, ChatCompletionRequest, EmbeddingRequest, RerankRequest, ScoreRequest,
                 TokenizeRequest, DetokenizeRequest, LoadLoraAdapterRequest, UnloadLoraAdapterRequest,
                 TranscriptionRequest, TranslationRequest, Transcription, VerboseTranscription, ErrorResponse)
"""The POST routes' bodies and the error body: `publish_schema` adds them to the components."""
ERROR_BODY = {"application/json": {"schema": {"$ref": REF_TEMPLATE.format(model="ErrorResponse")}}}
ERRORS = {"4XX": {"content": ERROR_BODY}, "5XX": {"content": ERROR_BODY}}
"""Every error has OpenAI's body (JSON, on /metrics too). Declaring 4XX also keeps FastAPI from
listing a 422 it never sends."""


def publish_schema(app: FastAPI) -> None:
    """Make `app.openapi()` FastAPI's document plus the JSON schemas of `SCHEMA_MODELS` and their
    nested models in components/schemas, so that every `$ref` of `json_body` and `ERRORS` resolves."""

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


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """An operation's requestBody, declared only: the route validates the raw body itself."""
    schema = {"$ref": REF_TEMPLATE.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def form_body(model: type[BaseModel]) -> dict[str, Any]:
    """An audio route's requestBody, declared only: a multipart form of `model`'s fields and the file."""
    schema = {"allOf": [{"$ref": REF_TEMPLATE.format(model=model.__name__)},
                        {"type": "object", "required": ["file"], "properties": {
                            "file": {"type": "string", "format": "binary",
                                     "description": "The audio: wav, flac, mp3, ogg/opus, webm, m4a, ..."}}}]}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}


def audio_ok(chunk: Optional[type[BaseModel]] = None) -> dict[Any, Any]:
    """An audio route's 200: JSON (json, verbose_json), text (text, srt, vtt) or, with `chunk`, events."""
    content: dict[str, Any] = {
        "application/json": {"schema": {"anyOf": [{"$ref": REF_TEMPLATE.format(model=m.__name__)}
                                                  for m in (Transcription, VerboseTranscription)]}},
        "text/plain": {"schema": {"type": "string"}}}
    if chunk is not None:
        content["text/event-stream"] = {"schema": {"type": "string", "description": f"data: <{chunk.__name__} or "
                                                   "TranscriptTextDone JSON> events, then data: [DONE]"}}
    return {200: {"content": content}}


def ok(model: type[BaseModel], chunk: Optional[type[BaseModel]] = None, streams: bool = True) -> dict[Any, Any]:
    """The 200 of a POST route: `model` as JSON, or (where it `streams`) with `stream: true`
    server-sent events, each `data: <chunk>` (a `chunk`, by default `model` again), then `data: [DONE]`."""
    if not streams:
        return {200: {"model": model}}
    events = {"type": "string", "description": f"data: <{(chunk or model).__name__} JSON> events, then data: [DONE]"}
    return {200: {"model": model, "content": {"text/event-stream": {"schema": events}}}}
