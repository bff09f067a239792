"""What every OpenAI request model shares: parsing a body or a form into a model with OpenAI-shaped
errors, the base class with its invariants, the usage and error bodies.

Each request class lists its fields in the order of OpenAI's API reference (required fields first,
then alphabetical); this server's extensions come from the shared base class. Invariants of every
request model:
  * `null` means "the default": null-valued fields are dropped before validation;
  * an unknown field is a 400 (`extra="forbid"`), like OpenAI's own API, so typos are never ignored;
  * a known OpenAI field this server cannot honour yet is a 400 that says so, unless it has its
    neutral value (e.g. `response_format={"type": "text"}`, `tools=[]`).
Numeric ranges of sampling fields are checked once, by `engine.generate.request.SamplingParams`; sizes
(prompts, n, stop strings, logit_bias, logprobs) are bounded by the server's configurable limits,
checked by the ingress (`serve_app.http.limits`).
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from serve_app.errors import BadRequest

Prompt = Union[str, list[int]]
"""One prompt: text, or token ids."""
PromptInput = Union[str, list[str], list[int], list[list[int]]]
"""A completion request's `prompt`: one prompt or a batch (the published schema's type too)."""


def invalid(param: str, message: str) -> PydanticCustomError:
    """A validation error that names its field (also from model-level validators)."""
    return PydanticCustomError("invalid_request", "{message}", {"message": message, "param": param})


def parse_request(model: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON body into `model`; any problem is a `BadRequest` naming the field."""
    return _validated(lambda: model.model_validate_json(body))


def parse_form(model: type[BaseModel], fields: dict[str, Any]) -> Any:
    """Validate a multipart form's fields (strings, or lists of them) into `model`, as `parse_request`."""
    return _validated(lambda: model.model_validate(fields))


def _validated(validate) -> Any:
    try:
        return validate()
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        loc, named = ".".join(str(p) for p in first["loc"]), (first.get("ctx") or {}).get("param")
        param = f"{loc}.{named}" if loc and named and not loc.endswith(named) else loc or named
        raise BadRequest("; ".join(_describe(e) for e in errors), param) from None


def _describe(error: dict) -> str:
    loc = ".".join(str(p) for p in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"'{loc}' is not a supported field; remove it"
    if error["type"] in ("invalid_request", "json_invalid") or not loc:
        return error["msg"]
    return f"{loc}: {error['msg']}"


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)  # docstrings describe fields in /docs

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def unsupported(supported: dict[str, tuple]):
    """A validator rejecting values of known-but-unsupported fields, except their neutral values."""

    def check(cls, value: Any, info) -> Any:
        allowed = supported[info.field_name]
        if value not in allowed:
            hint = f"; only {' or '.join(repr(a) for a in allowed)} is accepted" if allowed else ""
            raise invalid(info.field_name, f"'{info.field_name}' is not supported yet{hint}")
        return value

    return field_validator(*supported)(classmethod(check))






class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    """Every error's body (`serve_app.errors.APIError.body`), published in the OpenAPI schema."""

    error: ErrorInfo


def check_prompts(value: Any, param: str) -> PromptInput:
    """One prompt or a batch: text, texts, token ids, or token-id lists."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value) or all(is_token_ids(p) for p in value):
            return value
        if is_token_ids(value):
            return value
    raise invalid(
        param,
        f"{param} must be a string, a non-empty list of strings, a non-empty list of token ids, "
        "or a non-empty list of non-empty token-id lists",
    )


def prompt_batch(value: PromptInput) -> list[Prompt]:
    return [value] if isinstance(value, str) or is_token_ids(value) else list(value)


def is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )
