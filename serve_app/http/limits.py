"""Bounds on one request, enforced by the ingress before any model server sees it.

`BodySizeLimit` (ASGI middleware) answers a body over `max_request_body_bytes` with a 413: at once,
unread, when Content-Length says so; otherwise (chunked) as soon as the bytes read pass the limit.
Invariant: the ingress never holds more than the limit plus one received chunk of a body.
`check_limits` refuses a parsed request that asks for too much with a 400 naming the field, the
server's limit and the setting that holds it.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app.config import RequestLimits
from serve_app.errors import BadRequest, PayloadTooLarge
from serve_app.protocol.chat import ChatCompletionRequest
from serve_app.protocol.completions import CompletionRequest
from serve_app.protocol.embeddings import EmbeddingRequest
from serve_app.protocol.score import RerankRequest, ScoreRequest


class BodySizeLimit:
    """Refuses HTTP request bodies over `max_bytes` with an OpenAI-shaped 413."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _declared_length(scope) > self.max_bytes:
            await self._refuse(scope, receive, send)  # the body stays unread
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # the route's error handling answers 413
                    raise self.too_large()
            return message

        await self.app(scope, limited_receive, send)

    def too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"the request body is larger than this server's limit of {self.max_bytes} bytes; send a "
            "smaller request, or raise the server's max_request_body_bytes"
        )

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = self.too_large()
        await JSONResponse(error.body(), status_code=error.status, headers=error.headers())(scope, receive, send)


def _declared_length(scope: Scope) -> int:
    """The Content-Length header's value; -1 when absent or malformed (then bytes are counted)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else -1
    return -1


def _inputs(request: Any) -> tuple[str, str, int] | None:
    """(param, what, count) of an embeddings, rerank or score request's inputs; None for others."""
    if isinstance(request, EmbeddingRequest):
        return "input", "inputs", len(request.inputs)
    if isinstance(request, RerankRequest):
        return "documents", "documents", len(request.documents)
    if isinstance(request, ScoreRequest):
        return "text_2", "pairs", len(request.pairs)
    return None


def check_limits(request: Any, limits: RequestLimits) -> None:
    """Raise `BadRequest` for the first limit `request` exceeds (an embeddings request: its inputs
    count as prompts, as a rerank's documents and a score request's pairs do; /tokenize and
    /detokenize have no limit but the body size)."""
    counted = _inputs(request)
    if counted is not None:
        param, what, inputs = counted
        if inputs > limits.max_prompts_per_request:
            raise BadRequest(f"{param} holds {inputs} {what}, over this server's limit of "
                             f"{limits.max_prompts_per_request} (max_prompts_per_request); split them over several "
                             "requests", param)
        return
    if not isinstance(request, (CompletionRequest, ChatCompletionRequest)):
        return
    prompts = len(request.prompts) if isinstance(request, CompletionRequest) else 1
    images = 0 if isinstance(request, CompletionRequest) else sum(len(m.image_urls) for m in request.messages)
    choices, longest_stop = prompts * request.n, max(map(len, request.stops), default=0)
    logprobs = "logprobs" if isinstance(request, CompletionRequest) else "top_logprobs"
    checks = [
        ("prompt", f"prompt holds {prompts} prompts", prompts, "max_prompts_per_request",
         "split them over several requests"),
        ("messages", f"the messages hold {images} images", images, "max_images_per_request", "send fewer"),
        ("n", f"n is {request.n}", request.n, "max_n", "lower n"),
        ("n", f"prompts x n is {choices} choices ({prompts} x {request.n})", choices, "max_choices_per_request",
         "send fewer prompts or a lower n"),
        ("stop", f"stop holds {len(request.stops)} strings", len(request.stops), "max_stop_strings", "send fewer"),
        ("stop", f"stop holds a string of {longest_stop} characters", longest_stop, "max_stop_string_chars",
         "shorten it"),
        ("stop_token_ids", f"stop_token_ids holds {len(request.stop_token_ids)} ids", len(request.stop_token_ids),
         "max_stop_token_ids", "send fewer"),
        ("logit_bias", f"logit_bias holds {len(request.logit_bias)} entries", len(request.logit_bias),
         "max_logit_bias_entries", "send fewer"),
        (logprobs, f"{logprobs} is {getattr(request, logprobs)}", getattr(request, logprobs) or 0, "max_logprobs",
         f"lower {logprobs}"),
    ]
    for param, what, value, setting, fix in checks:
        limit = getattr(limits, setting)
        if value > limit:
            raise BadRequest(f"{what}, over this server's limit of {limit} ({setting}); {fix}", param)
