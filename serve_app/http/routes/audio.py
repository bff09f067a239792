"""/v1/audio/transcriptions and /v1/audio/translations: a multipart form with the audio file, answered
in the asked format or (transcriptions) streamed as text deltas."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from serve_app.errors import BadRequest
from serve_app.http.backends import ModelBackend
from serve_app.http.dispatch import respond, serve_request
from serve_app.http.schema import audio_ok, form_body
from serve_app.protocol.audio import (
    AudioRequest,
    TranscriptionRequest,
    TranscriptTextDelta,
    TranslationRequest,
)
from serve_app.protocol.base import parse_form
from serve_app.protocol.context import RequestContext

MAX_FORM_FIELDS = 32
"""Fields a multipart form may carry besides its file (an OpenAI client sends at most ~10)."""

router = APIRouter(prefix="/v1")


@router.post("/audio/transcriptions", openapi_extra=form_body(TranscriptionRequest),
             responses=audio_ok(TranscriptTextDelta))
async def audio_transcriptions(raw: Request) -> Response:
    return await serve_request(raw, TranscriptionRequest, _transcribe, read_audio_form)


@router.post("/audio/translations", openapi_extra=form_body(TranslationRequest), responses=audio_ok())
async def audio_translations(raw: Request) -> Response:
    return await serve_request(raw, TranslationRequest, _transcribe, read_audio_form)


async def _transcribe(backend: ModelBackend, request: AudioRequest, context: RequestContext) -> Response:
    if request.stream:
        return await respond(backend, request, context)
    body, media_type = await backend.call("transcribe", request, context.arrival_time)
    return Response(body, media_type=media_type)


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
