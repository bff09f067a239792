"""/v1/chat/completions: messages, tools, the request, the response and its stream chunks."""

from __future__ import annotations

import json
import time
from typing import Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    field_validator,
    model_serializer,
    model_validator,
)

from engine.generate.request import SamplingParams
from serve_app.protocol.base import OpenAIModel, Usage, invalid, unsupported
from serve_app.protocol.sampling import SamplingRequest, StreamOptions

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
placeholder there (serve_app.text.tokenizer)."""


class ChatMessage(OpenAIModel):
    """One message of the conversation. Content is text, or a list of text and `image_url` parts
    (joined by newlines; an image stands as IMAGE_MARKER, its URL kept in `image_urls`). An
    assistant message may carry the `tool_calls` it made (then content may be null) and the thinking
    that led to them (`reasoning_content`); a `tool` message answers one of the calls (`tool_call_id`)."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[dict[str, Any]]] = ""
    name: Optional[str] = None
    audio: Any = None
    function_call: Any = None
    refusal: Any = None
    tool_call_id: Optional[str] = None
    tool_calls: list[MessageToolCall] = []
    reasoning_content: Optional[str] = None
    """An assistant message's thinking (vLLM's field, as this server answers it), handed back to the
    chat template as `reasoning_content` and as `thinking`; templates decide where to keep it (gpt-oss
    keeps the analysis before a tool call, so a tool-calling turn goes on from its own reasoning)."""
    reasoning: Optional[str] = None
    """OpenRouter's name for `reasoning_content`; where both are sent they must agree."""

    _supported = unsupported({"audio": (), "function_call": (), "refusal": ()})

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

    @model_validator(mode="after")
    def _reasoning_fields(self) -> "ChatMessage":
        sent = [field for field in ("reasoning_content", "reasoning") if getattr(self, field) is not None]
        if sent and self.role != "assistant":
            raise invalid(sent[0], f"only assistant messages carry {sent[0]} (the model's earlier thinking), not "
                          f"role '{self.role}'")
        if len(sent) == 2 and self.reasoning_content != self.reasoning:
            raise invalid("reasoning", "reasoning is another name for reasoning_content and differs from it; send "
                          "one of them")
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

    @property
    def thought(self) -> Optional[str]:
        """The thinking an assistant message carries back, under either of its names."""
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: `developer` is the newer name of `system`;
        tool-call arguments as objects (as Hugging Face templates render them), not JSON text;
        earlier thinking as `reasoning_content` (Qwen3's templates) and `thinking` (gpt-oss's)."""
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
        if self.thought is not None:
            message["reasoning_content"] = message["thinking"] = self.thought
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

    _supported = unsupported(
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
