"""OpenAI request and response models.

Each request class lists its fields in the order of OpenAI's API reference (required fields first,
then alphabetical); this server's extensions come from the shared base class. Invariants of every
request model:
  * `null` means "the default": null-valued fields are dropped before validation;
  * an unknown field is a 400 (`extra="forbid"`), like OpenAI's own API, so typos are never ignored;
  * a known OpenAI field this server cannot honour yet is a 400 that says so, unless it has its
    neutral value (e.g. `response_format={"type": "text"}`, `tools=[]`).
Numeric ranges of sampling fields are checked once, by `engine.core.request.SamplingParams`; sizes
(prompts, n, stop strings, logit_bias, logprobs) are bounded by the server's configurable limits,
checked by the ingress (`serve_app.limits`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engine.core.request import Grammar, SamplingParams
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


def _unsupported(supported: dict[str, tuple]):
    """A validator rejecting values of known-but-unsupported fields, except their neutral values."""

    def check(cls, value: Any, info) -> Any:
        allowed = supported[info.field_name]
        if value not in allowed:
            hint = f"; only {' or '.join(repr(a) for a in allowed)} is accepted" if allowed else ""
            raise invalid(info.field_name, f"'{info.field_name}' is not supported yet{hint}")
        return value

    return field_validator(*supported)(classmethod(check))


def _check_stop(value: Union[str, list[str]]) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if any(s == "" for s in stops):
        raise invalid("stop", "stop strings must not be empty")
    return stops


def _check_logit_bias(bias: dict[str, float]) -> dict[str, float]:
    for key, value in bias.items():
        if not key.lstrip("-").isdigit():
            raise invalid("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
        if not -100.0 <= value <= 100.0:
            raise invalid("logit_bias", f"logit_bias values must be in [-100, 100], got {value} for {key}")
    return bias


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    """Send a last chunk with `usage` (and no choices)."""


class JsonSchemaFormat(OpenAIModel):
    """`response_format.json_schema`: the schema the output must match."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Optional[str] = None
    schema_: dict[str, Any] = Field({}, alias="schema")
    """A JSON Schema (the draft 2020-12 subset llguidance compiles). Empty: any JSON value."""
    strict: Optional[bool] = None
    """Accepted; the output always matches the schema (constrained decoding)."""


class ResponseFormat(OpenAIModel):
    """`text`: free text. `json_object`: a JSON object. `json_schema`: JSON matching the schema.
    The output is constrained token by token, so it matches whatever the model would rather say;
    a generation cut by max_tokens ends with finish_reason `length` (and is then incomplete)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise invalid("response_format", "response_format.json_schema must be given exactly when type is "
                          "'json_schema'")
        return self

    def grammar(self) -> Optional[Grammar]:
        if self.type == "json_object":
            return Grammar("json_schema", '{"type": "object"}')
        if self.type == "json_schema":
            return Grammar("json_schema", json.dumps(self.json_schema.schema_), "response_format.json_schema.schema")
        return None


class StructuredOutputs(OpenAIModel):
    """vLLM's `structured_outputs` extension: exactly one constraint on the output."""

    json_: Optional[Union[dict[str, Any], str]] = Field(None, alias="json")
    """A JSON schema (an object or its JSON text)."""
    regex: Optional[str] = None
    """A regular expression (Rust regex syntax) the whole output matches."""
    choice: Optional[list[str]] = Field(None, min_length=1)
    """The output is exactly one of these strings."""
    grammar: Optional[str] = None
    """A Lark grammar (llguidance's dialect), starting at `start`."""

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise invalid("structured_outputs", "structured_outputs takes exactly one of json, regex, choice, grammar")
        return self

    def grammar_spec(self) -> Grammar:
        param = "structured_outputs"
        if self.json_ is not None:
            schema = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
            return Grammar("json_schema", schema, param)
        if self.regex is not None:
            return Grammar("regex", self.regex, param)
        if self.choice is not None:
            return Grammar("lark", "start: " + " | ".join(json.dumps(c) for c in self.choice), param)
        return Grammar("lark", self.grammar, param)


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
"""vLLM's older structured-output fields and the structured_outputs key each means."""


class SamplingRequest(OpenAIModel):
    """The base of both request models: this server's extensions beyond OpenAI's fields (vLLM's
    names and meanings), and what both endpoints share."""

    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = []
    """Generation stops after any of these tokens (kept in the token count, not in the text)."""
    ignore_eos: bool = False
    min_tokens: int = 0
    response_format: Optional[ResponseFormat] = None
    """Constrain the output to JSON (an OpenAI field on chat; an extension on completions)."""
    structured_outputs: Optional[StructuredOutputs] = None
    """vLLM's extension: constrain the output to a JSON schema, a regex, a choice or a grammar."""
    guided_json: Optional[Union[dict[str, Any], str]] = None
    """vLLM's older name of structured_outputs.json (still sent by many clients)."""
    guided_regex: Optional[str] = None
    """vLLM's older name of structured_outputs.regex."""
    guided_choice: Optional[list[str]] = None
    """vLLM's older name of structured_outputs.choice."""
    guided_grammar: Optional[str] = None
    """vLLM's older name of structured_outputs.grammar."""
    # vLLM fields accepted at their defaults only (what this server does); another value is a 400.
    skip_special_tokens: bool = True
    """Special tokens are left out of the text (only true is accepted)."""
    spaces_between_special_tokens: bool = True
    """(only true is accepted)"""
    include_stop_str_in_output: bool = False
    """A matched stop string is left out of the text (only false is accepted)."""
    use_beam_search: bool = False
    """(only false is accepted: sampling or greedy decoding)"""
    priority: int = 0
    """(only 0 is accepted: requests are served first come, first served)"""

    _neutral = _unsupported({"skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
                             "include_stop_str_in_output": (False,), "use_beam_search": (False,), "priority": (0,)})

    @model_validator(mode="after")
    def _one_constraint(self) -> "SamplingRequest":
        given = [name for name in ("structured_outputs", *GUIDED) if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        if len(given) > 1:
            raise invalid(given[1], f"send one constraint on the output, not {' and '.join(given)}")
        if given and given[0] in GUIDED:
            self._guided()  # checked now: a bad one is a 400 naming its field
        return self

    def _guided(self) -> Optional[Grammar]:
        """The grammar of the guided_* field that is set (vLLM's older names), naming that field."""
        name = next((n for n in GUIDED if getattr(self, n) is not None), None)
        if name is None:
            return None
        try:
            spec = StructuredOutputs.model_validate({GUIDED[name]: getattr(self, name)}).grammar_spec()
        except ValidationError as exc:
            raise invalid(name, f"{name}: {exc.errors()[0]['msg']}") from None
        return dataclasses.replace(spec, param=name)

    def grammar(self) -> Optional[Grammar]:
        """The constraint on the output, if the request sets one."""
        if self.structured_outputs is not None:
            return self.structured_outputs.grammar_spec()
        if self.response_format is not None and self.response_format.type != "text":
            return self.response_format.grammar()
        return self._guided()

    _stop = field_validator("stop", check_fields=False)(classmethod(lambda cls, v: _check_stop(v)))
    _logit_bias = field_validator("logit_bias", check_fields=False)(classmethod(lambda cls, v: _check_logit_bias(v)))

    def sampling_params(self, **kwargs) -> SamplingParams:
        """SamplingParams from the fields both endpoints share, plus `kwargs`; raises
        `InvalidRequestError` (a 400) for out-of-range values."""
        return SamplingParams(
            min_tokens=self.min_tokens,
            temperature=self.temperature,
            top_k=0 if self.top_k == -1 else self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=tuple((int(k), float(v)) for k, v in self.logit_bias.items()),
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            grammar=self.grammar(),
            **kwargs,
        )

    @property
    def stops(self) -> list[str]:
        return list(self.stop)  # validated into a list

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "stream_options is only allowed when stream is true")


# ---- requests ----


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    model: str
    prompt: PromptInput
    """Text, a batch of texts, token ids, or a batch of token-id lists."""
    best_of: Optional[int] = None
    """Only best_of == n is supported (each choice is one sample)."""
    echo: bool = False
    """Prepend the prompt to the text (and its token logprobs to `logprobs`, the first null)."""
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] = {}
    logprobs: Optional[int] = None
    """Logprobs of the chosen tokens plus this many alternatives (0-20)."""
    max_tokens: int = Field(16, ge=0)
    """0 (with echo) scores the prompt only: the engine makes one token, which is dropped."""
    n: int = Field(1, ge=1)
    """Choices per prompt; at most the server's max_n (see serve_app.limits)."""
    presence_penalty: float = 0.0
    seed: Optional[int] = None
    """Choice i of a prompt samples with seed + i."""
    stop: Union[str, list[str]] = []
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    suffix: Optional[str] = None
    temperature: float = 1.0
    top_p: float = 1.0
    user: Optional[str] = None
    """Accepted and not used."""

    _supported = _unsupported({"suffix": ()})

    @field_validator("prompt", mode="plain", json_schema_input_type=PromptInput)
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        return _check_prompts(value, "prompt")

    @model_validator(mode="after")
    def _cross_field_rules(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of < self.n:
            raise invalid("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of is not None and self.best_of > self.n:
            raise invalid("best_of", "best_of > n is not supported yet; set best_of to n or leave it out")
        self._check_stream_options()
        return self

    @property
    def prompts(self) -> list[Prompt]:
        """The batch: one entry per prompt."""
        return _batch(self.prompt)

    def to_sampling_params(self) -> SamplingParams:
        """max_tokens=0 asks the engine for one token (its minimum); the server drops it."""
        return self.sampling_params(
            max_tokens=max(self.max_tokens, 1),
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo else None,
        )


def _check_prompts(value: Any, param: str) -> PromptInput:
    """One prompt or a batch: text, texts, token ids, or token-id lists."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value) or all(_is_token_ids(p) for p in value):
            return value
        if _is_token_ids(value):
            return value
    raise invalid(
        param,
        f"{param} must be a string, a non-empty list of strings, a non-empty list of token ids, "
        "or a non-empty list of non-empty token-id lists",
    )


def _batch(value: PromptInput) -> list[Prompt]:
    return [value] if isinstance(value, str) or _is_token_ids(value) else list(value)


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDefinition(OpenAIModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    """A JSON Schema of the arguments object. None: the function takes no arguments."""
    strict: Optional[bool] = None
    """Accepted; calls made under tool_choice `required` or a named function always match
    `parameters` (constrained decoding), calls the model makes on its own (`auto`) are parsed."""


class Tool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    """Forces a call of this function."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class CalledFunction(OpenAIModel):
    name: str
    arguments: str
    """The arguments object as JSON text."""


class MessageToolCall(OpenAIModel):
    """A call an assistant message made (in a request's history)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


IMAGE_MARKER = "<|jax-serve:image|>"
"""Where an image part stands in a message's text; the tokenizer puts the model's image
placeholder there (serve_app.tokenizer)."""


class ChatMessage(OpenAIModel):
    """One message of the conversation. Content is text, or a list of text and `image_url` parts
    (joined by newlines; an image stands as IMAGE_MARKER, its URL kept in `image_urls`). An
    assistant message may carry the `tool_calls` it made (then content may be null); a `tool`
    message answers one of them (`tool_call_id`)."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[dict[str, Any]]] = ""
    name: Optional[str] = None
    audio: Any = None
    function_call: Any = None
    refusal: Any = None
    tool_call_id: Optional[str] = None
    tool_calls: list[MessageToolCall] = []

    _supported = _unsupported({"audio": (), "function_call": (), "refusal": ()})

    @field_validator("role")
    @classmethod
    def _role(cls, value: str) -> str:
        if value == "function":
            raise invalid("role", "messages with role 'function' (deprecated by OpenAI) are not supported; send "
                          "role 'tool' with a tool_call_id")
        return value

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        if self.role == "tool" and self.tool_call_id is None:
            raise invalid("tool_call_id", "a message with role 'tool' needs the tool_call_id it answers")
        if self.tool_calls and self.role != "assistant":
            raise invalid("tool_calls", f"only assistant messages carry tool_calls, not role '{self.role}'")
        for call in self.tool_calls:
            _arguments_object(call.function.arguments)
        return self

    _image_urls: list[str] = PrivateAttr(default_factory=list)

    @field_validator("content")
    @classmethod
    def _content(cls, value: Union[str, list[dict[str, Any]]]) -> str:
        if isinstance(value, str):
            return value
        texts = []
        for part in value:
            if part.get("type") == "image_url":
                _image_url(part)
                texts.append(IMAGE_MARKER)
            elif part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise invalid("content", f"content parts of type {part.get('type')!r} are not supported; send "
                              "text and image_url parts")
        return "\n".join(texts)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_image_urls(cls, data: Any, handler) -> "ChatMessage":
        message = handler(data)
        content = data.get("content") if isinstance(data, dict) else None
        if isinstance(content, list):
            message._image_urls = [_image_url(p) for p in content if p.get("type") == "image_url"]
        return message

    @property
    def image_urls(self) -> list[str]:
        """The URLs of the message's image parts, in order."""
        return self._image_urls

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: `developer` is the newer name of `system`;
        tool-call arguments as objects (as Hugging Face templates render them), not JSON text."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _arguments_object(c.function.arguments)}}
                for c in self.tool_calls
            ]
        return message


def _image_url(part: dict[str, Any]) -> str:
    """The URL of an `image_url` content part (`{"image_url": {"url": ..., "detail": ...}}`)."""
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image if isinstance(image, str) else None
    if not isinstance(url, str) or not url:
        raise invalid("content", "an image_url part needs image_url.url: a data: URI (or an http(s) URL)")
    if isinstance(image, dict) and image.get("detail", "auto") not in ("auto", "low", "high"):
        raise invalid("content", f"image_url.detail must be auto, low or high, not {image.get('detail')!r}")
    return url


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        raise invalid("tool_calls", f"tool call arguments must be JSON text, got {arguments[:80]!r}") from None


TEMPLATE_ARGUMENTS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                "continue_final_message", "tokenize", "return_dict", "chat_template"})
"""apply_chat_template's own arguments: the request's fields set them, chat_template_kwargs may not."""


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    model: str
    audio: Any = None
    frequency_penalty: float = 0.0
    function_call: Any = None
    functions: Any = None
    logit_bias: dict[str, float] = {}
    logprobs: bool = False
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    """Deprecated by OpenAI in favour of max_completion_tokens, which wins when both are set.
    Neither: up to the model's length limit."""
    metadata: Any = None
    modalities: Any = None
    n: int = Field(1, ge=1)
    parallel_tool_calls: bool = True
    """Whether one answer may call several tools (false: at most one call)."""
    prediction: Any = None
    presence_penalty: float = 0.0
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    """Passed to the chat template as `reasoning_effort`: templates that read it (gpt-oss style)
    think as much as it says; others render as without it."""
    chat_template_kwargs: dict[str, Any] = {}
    """More variables for the chat template (vLLM's field), e.g. {"enable_thinking": false} for
    Qwen3."""
    seed: Optional[int] = None
    """Choice i samples with seed + i."""
    service_tier: Any = None
    stop: Union[str, list[str]] = []
    store: Any = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: float = 1.0
    tool_choice: Optional[ToolChoice] = None
    """none: no call (the tools are not shown to the model); auto (the default with tools): the
    model may call tools in its own format, which is parsed; required: at least one call; a named
    function: a call of it. Required and named calls are constrained to the declared parameters."""
    tools: list[Tool] = []
    """Functions the model may call; the chat template renders them."""
    top_logprobs: Optional[int] = None
    """Alternatives per token (0-20); needs logprobs=true."""
    top_p: float = 1.0
    user: Optional[str] = None
    """Accepted and not used."""
    web_search_options: Any = None

    _supported = _unsupported(
        {
            "audio": (),
            "function_call": ("none",),
            "functions": ([],),
            "metadata": (),
            "modalities": (["text"],),
            "prediction": (),
            "service_tier": ("auto", "default"),
            "store": (False,),
            "web_search_options": (),
        }
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(value) & TEMPLATE_ARGUMENTS)
        if taken:
            raise invalid("chat_template_kwargs", f"chat_template_kwargs must not set {taken}: the server renders "
                          "those from the request's own fields")
        return value

    @model_validator(mode="after")
    def _cross_field_rules(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "top_logprobs needs logprobs=true")
        self._check_stream_options()
        self._check_tools()
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra variables: chat_template_kwargs, and reasoning_effort if set."""
        extra = dict(self.chat_template_kwargs)
        if self.reasoning_effort is not None:
            extra["reasoning_effort"] = self.reasoning_effort
        return extra

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise invalid("tools", f"tool names must be unique, got {names}")
        choice = self.tool_choice
        if (choice in ("auto", "required") or isinstance(choice, NamedToolChoice)) and not self.tools:
            raise invalid("tool_choice", "tool_choice needs tools; declare them in 'tools'")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise invalid("tool_choice", f"tool_choice names function {choice.function.name!r}, which is not "
                          f"among the declared tools {names}")
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        if forced and self.grammar() is not None:
            param = "structured_outputs" if self.structured_outputs is not None else "response_format"
            raise invalid(param, f"{param} cannot be combined with a required or named tool_choice: the calls' "
                          "arguments already follow the tools' schemas")

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required", or "function" (tool_choice names one: `forced_function`)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "function"
        return self.tool_choice or "auto"

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """`default_max_tokens` applies when the request sets no limit (the room left in the
        model's context)."""
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens=max_tokens, logprobs=logprobs)


class EmbeddingRequest(OpenAIModel):
    """POST /v1/embeddings."""

    input: PromptInput
    """Text, a batch of texts, token ids, or a batch of token-id lists (token ids are used as
    given: the model's special tokens are not added)."""
    model: str
    dimensions: Optional[int] = Field(None, ge=1)
    """Only for models trained to be truncated (Matryoshka); otherwise their own size or nothing."""
    encoding_format: Literal["float", "base64"] = "float"
    """base64: each vector as little-endian float32 bytes, base64-encoded (as OpenAI sends it)."""
    user: Optional[str] = None
    """Accepted and not used."""

    @field_validator("input", mode="plain", json_schema_input_type=PromptInput)
    @classmethod
    def _input(cls, value: Any) -> Any:
        return _check_prompts(value, "input")

    @property
    def inputs(self) -> list[Prompt]:
        return _batch(self.input)


class TokenizeRequest(OpenAIModel):
    """POST /tokenize (vLLM's shape): a `prompt` as /v1/completions tokenizes it, or `messages`
    (and `tools`) as /v1/chat/completions renders them."""

    model: str
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    tools: list[Tool] = []
    add_generation_prompt: bool = True
    """With messages: end with the assistant's turn (as chat completions do)."""
    add_special_tokens: Optional[bool] = None
    """Add the tokenizer's special tokens (BOS): default true for a prompt, false for messages
    (the template writes them)."""
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise invalid("prompt", "send either 'prompt' or 'messages'")
        return self


class DetokenizeRequest(OpenAIModel):
    """POST /detokenize (vLLM's shape)."""

    model: str
    tokens: list[int]


class LoadLoraAdapterRequest(OpenAIModel):
    """POST /v1/load_lora_adapter (vLLM's shape)."""

    lora_name: str = Field(min_length=1)
    """The name clients then send as `model`."""
    lora_path: str = Field(min_length=1)
    """A PEFT adapter directory on the replicas' hosts."""
    load_inplace: bool = False
    """Replace an adapter already loaded under this name (requests running with it keep it)."""
    base_model_name: Optional[str] = None
    """This server's extension: the served model the adapter adapts (needed only when it serves
    several text generation models)."""


class UnloadLoraAdapterRequest(OpenAIModel):
    """POST /v1/unload_lora_adapter (vLLM's shape)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: Optional[int] = None
    """vLLM's field; accepted and not used (adapters are known by name)."""


# ---- responses ----


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str] = []
    token_logprobs: list[Optional[float]] = []
    top_logprobs: list[Optional[dict[str, float]]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    """Both the response and each stream chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    """Null when the answer is tool calls only."""
    reasoning_content: Optional[str] = None
    """A reasoning model's thinking (vLLM's field); left out for a model that does not think."""
    tool_calls: list[dict[str, Any]] = []
    """{"id", "type": "function", "function": {"name", "arguments"}} per call; left out when none
    (as OpenAI does)."""

    @model_serializer(mode="wrap")
    def _without_empty_calls(self, handler) -> dict[str, Any]:
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        if data.get("reasoning_content") is None:
            data.pop("reasoning_content", None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    """New thinking of a reasoning model; left out when none."""
    tool_calls: Optional[list[dict[str, Any]]] = None
    """A call's first delta: {"index", "id", "type": "function", "function": {"name", "arguments": ""}};
    then {"index", "function": {"arguments": <fragment>}}. Left out when none."""

    @model_serializer(mode="wrap")
    def _without_empty_calls(self, handler) -> dict[str, Any]:
        data = handler(self)
        for optional in ("tool_calls", "reasoning_content"):
            if data.get(optional) is None:
                data.pop(optional, None)
        return data


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    """Every error's body (`serve_app.errors.APIError.body`), published in the OpenAPI schema."""

    error: ErrorInfo


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: Union[list[float], str]
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(BaseModel):
    prompt: str


class TranslationRequest(OpenAIModel):
    """POST /v1/audio/translations: a multipart form; the audio is its `file` part. The speech is
    translated into English."""

    model: str
    prompt: Optional[str] = None
    """Text in the audio's style or the words before it: fed before every 30-second window (its
    last tokens, up to half the decoder's context)."""
    response_format: Literal["json", "text", "srt", "verbose_json", "vtt"] = "json"
    temperature: float = Field(0.0, ge=0.0, le=1.0)
    """0: greedy decoding; above 0: sampling. A window whose text repeats or is unlikely is decoded
    again hotter, up to 1.0, and silence is dropped (the model's `transcription_fallback`)."""
    seed: Optional[int] = None
    """This server's extension: makes sampling at temperature > 0 repeatable."""

    @property
    def task(self) -> str:
        return "translate"


class TranscriptionRequest(TranslationRequest):
    """POST /v1/audio/transcriptions: a multipart form; the audio is its `file` part."""

    language: Optional[str] = None
    """The audio's language as an ISO-639-1 code ("en"); default: detected from its first 30 s."""
    timestamp_granularities: list[Literal["segment", "word"]] = ["segment"]
    """With verbose_json: "segment" (the answer's `segments`), "word" (its `words`, timed from the
    model's alignment heads), or both."""
    stream: bool = False
    """Server-sent events: `transcript.text.delta` as each window's text is final, then
    `transcript.text.done` (response_format json or text)."""

    @field_validator("language", mode="before")
    @classmethod
    def _language(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) and value.strip() else None

    @model_validator(mode="after")
    def _supported(self) -> "TranscriptionRequest":
        if "word" in self.timestamp_granularities and self.response_format != "verbose_json":
            raise invalid("timestamp_granularities", f"word timestamps come in verbose_json; set response_format "
                          f"verbose_json, not {self.response_format}")
        if self.stream and self.response_format not in ("json", "text"):
            raise invalid("stream", f"streaming sends text deltas; it takes response_format json or text, "
                          f"not {self.response_format}")
        return self

    @property
    def task(self) -> str:
        return "transcribe"


@dataclasses.dataclass(frozen=True)
class AudioRequest:
    """A transcription or translation with its audio file's bytes: what the ingress hands a speech
    replica (the form's fields validated, the file not yet decoded)."""

    params: Union[TranscriptionRequest, TranslationRequest]
    audio: bytes

    @property
    def model(self) -> str:
        return self.params.model

    @property
    def stream(self) -> bool:
        return getattr(self.params, "stream", False)


class TranscriptionUsage(BaseModel):
    type: Literal["duration"] = "duration"
    seconds: int
    """The audio's duration, rounded up to whole seconds."""


class TranscriptionSegment(BaseModel):
    id: int
    seek: int
    """The first 10 ms frame of the 30-second window the segment was decoded in."""
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


class TranscriptionWord(BaseModel):
    word: str
    start: float
    end: float


class Transcription(BaseModel):
    """response_format json."""

    text: str
    usage: TranscriptionUsage


class VerboseTranscription(BaseModel):
    """response_format verbose_json."""

    task: Literal["transcribe", "translate"]
    language: str
    """The language's English name ("english"), as OpenAI reports it."""
    duration: float
    text: str
    segments: Optional[list[TranscriptionSegment]] = None
    """With the "segment" granularity (the default)."""
    words: Optional[list[TranscriptionWord]] = None
    """With the "word" granularity."""
    usage: TranscriptionUsage


class TranscriptTextDelta(BaseModel):
    type: Literal["transcript.text.delta"] = "transcript.text.delta"
    delta: str


class TranscriptTextDone(BaseModel):
    type: Literal["transcript.text.done"] = "transcript.text.done"
    text: str
    usage: TranscriptionUsage


Task = Literal["generate", "embed", "transcribe"]
"""What a model serves: text (/v1/completions, /v1/chat/completions), embeddings (/v1/embeddings)
or speech to text (/v1/audio/transcriptions, /v1/audio/translations)."""


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jax-serve"
    root: Optional[str] = None
    """vLLM's field: where the model came from, e.g. a Hub repo id at its revision
    ("Qwen/Qwen3-0.6B@main"), an s3:// or gs:// URI, a local path, a builtin alias."""
    task: Task = "generate"
    """This server's extension: which routes serve the model."""
    state: Literal["ready", "starting", "failed"] = "ready"
    """This server's extension: whether the model takes requests now (starting: its replicas are
    loading or compiling, or retrying a failed start; failed: Serve gave up starting them)."""
    error: Optional[str] = None
    """This server's extension: why the model failed to start (or the last failed start while retrying)."""
    parent: Optional[str] = None
    """vLLM's field: for a LoRA adapter, the model it adapts (its `root` is the adapter's path)."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
