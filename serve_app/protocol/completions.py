"""/v1/completions: the request and the response."""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    Field,
    field_validator,
    model_validator,
)

from engine.generate.request import SamplingParams
from serve_app.protocol.base import (
    Prompt,
    PromptInput,
    Usage,
    check_prompts,
    invalid,
    prompt_batch,
    unsupported,
)
from serve_app.protocol.sampling import SamplingRequest, StreamOptions


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
    """Choices per prompt; at most the server's max_n (see serve_app.http.limits)."""
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

    _supported = unsupported({"suffix": ()})

    @field_validator("prompt", mode="plain", json_schema_input_type=PromptInput)
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        return check_prompts(value, "prompt")

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
        return prompt_batch(self.prompt)

    def to_sampling_params(self) -> SamplingParams:
        """max_tokens=0 asks the engine for one token (its minimum); the server drops it."""
        return self.sampling_params(
            max_tokens=max(self.max_tokens, 1),
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo else None,
        )








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
