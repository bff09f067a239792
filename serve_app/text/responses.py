"""OpenAI response objects from choice updates.

A model server turns each engine request's token deltas into `ChoiceUpdate`s (text, tokens with
their logprobs and text offsets, and on the last one the finish reason and token counts). A stream
sends one chunk per update; a full response merges a choice's updates into one and formats that.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

from engine.generate.request import TokenLogprob
from serve_app.protocol.base import PromptTokensDetails, Usage
from serve_app.protocol.chat import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
)
from serve_app.protocol.completions import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
)
from serve_app.text.detokenize import TokenStrings
from serve_app.text.tool_calls import ToolCall, ToolCallDelta


@dataclasses.dataclass
class TokenOut:
    """One token of a choice's output (or of its echoed prompt)."""

    token_id: int
    logprob: Optional[TokenLogprob]
    """None when logprobs were not asked for, and for the first prompt token (it has no prefix)."""
    offset: int
    """Characters of the choice's text before this token's text."""


@dataclasses.dataclass
class ChoiceCounts:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclasses.dataclass
class ChoiceUpdate:
    """New output of one choice. Invariant: the last update of a choice, and only it, has a
    finish reason and counts."""

    index: int
    text: str = ""
    tokens: list[TokenOut] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    counts: Optional[ChoiceCounts] = None
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)
    """Tool-call deltas (chat with tools), in order."""
    reasoning: str = ""
    """A reasoning model's new thinking (serve_app.text.reasoning)."""

    def extend(self, later: "ChoiceUpdate") -> None:
        self.text += later.text
        self.reasoning += later.reasoning
        self.tokens += later.tokens
        self.tool_calls += later.tool_calls
        self.finish_reason = later.finish_reason or self.finish_reason
        self.counts = later.counts or self.counts


def total_usage(finals: list[ChoiceUpdate], n: int) -> Usage:
    """Usage of a request: prompt tokens once per prompt (choice indices i*n .. i*n+n-1 share
    prompt i), completion tokens of every choice."""
    per_prompt = [u.counts for u in finals if u.index % n == 0]
    prompt = sum(c.prompt_tokens for c in per_prompt)
    completion = sum(u.counts.completion_tokens for u in finals)
    cached = sum(c.cached_tokens for c in per_prompt)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


class CompletionFormatter:
    """Shapes of /v1/completions."""

    def __init__(self, request_id: str, model: str, strings: TokenStrings, logprobs: bool):
        self._id, self._model, self._strings, self._logprobs = request_id, model, strings, logprobs
        self._created = int(time.time())

    def chunk(self, update: ChoiceUpdate) -> CompletionResponse:
        return self._response([self._choice(update)], None)

    def usage_chunk(self, usage: Usage) -> CompletionResponse:
        return self._response([], usage)

    def response(self, choices: list[ChoiceUpdate], usage: Usage) -> CompletionResponse:
        return self._response([self._choice(c) for c in choices], usage)

    def _response(self, choices: list[CompletionChoice], usage: Optional[Usage]) -> CompletionResponse:
        return CompletionResponse(id=self._id, created=self._created, model=self._model, choices=choices, usage=usage)

    def _choice(self, update: ChoiceUpdate) -> CompletionChoice:
        logprobs = self._completion_logprobs(update.tokens) if self._logprobs else None
        return CompletionChoice(
            text=update.text, index=update.index, logprobs=logprobs, finish_reason=update.finish_reason
        )

    def _completion_logprobs(self, tokens: list[TokenOut]) -> CompletionLogprobs:
        """Parallel lists; a token's `top_logprobs` holds the alternatives asked for plus itself."""
        out = CompletionLogprobs()
        for token in tokens:
            text = self._strings.text(token.token_id)
            out.tokens.append(text)
            out.text_offset.append(token.offset)
            if token.logprob is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            top = {self._strings.text(i): lp for i, lp in token.logprob.top}
            top.setdefault(text, token.logprob.logprob)
            out.token_logprobs.append(token.logprob.logprob)
            out.top_logprobs.append(top)
        return out


def _joined(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive deltas of one call as one (a chunk carries each call once: its header with
    the first fragments, or the fragments that followed)."""
    joined: list[ToolCallDelta] = []
    for delta in deltas:
        if joined and joined[-1].index == delta.index and delta.id is None:
            last = joined.pop()
            delta = dataclasses.replace(last, arguments=last.arguments + delta.arguments)
        joined.append(delta)
    return joined


def _message(choice: ChoiceUpdate) -> ChatResponseMessage:
    """A whole answer: its text, its thinking, and its tool calls joined from their deltas (a
    call's deltas come together, in call order; content null when the answer is calls or thinking
    only)."""
    calls = [ToolCall(d.id, d.name, d.arguments).to_openai() for d in _joined(choice.tool_calls)]
    content = choice.text if choice.text or not (calls or choice.reasoning) else None
    return ChatResponseMessage(content=content, reasoning_content=choice.reasoning or None, tool_calls=calls)


class ChatFormatter:
    """Shapes of /v1/chat/completions. The first chunk of each choice carries the role."""

    def __init__(self, request_id: str, model: str, strings: TokenStrings, logprobs: bool):
        self._id, self._model, self._strings, self._logprobs = request_id, model, strings, logprobs
        self._created = int(time.time())
        self._started: set[int] = set()

    def chunk(self, update: ChoiceUpdate) -> ChatCompletionChunk:
        role = None if update.index in self._started else "assistant"
        self._started.add(update.index)
        calls = [d.to_openai() for d in _joined(update.tool_calls)] or None
        choice = ChatChunkChoice(
            index=update.index,
            delta=ChatDelta(role=role, content=update.text if update.text or not (calls or update.reasoning) else None,
                            reasoning_content=update.reasoning or None, tool_calls=calls),
            logprobs=self._chat_logprobs(update.tokens),
            finish_reason=update.finish_reason,
        )
        return ChatCompletionChunk(id=self._id, created=self._created, model=self._model, choices=[choice])

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self._id, created=self._created, model=self._model, choices=[], usage=usage)

    def response(self, choices: list[ChoiceUpdate], usage: Usage) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self._id,
            created=self._created,
            model=self._model,
            choices=[
                ChatChoice(
                    index=c.index,
                    message=_message(c),
                    logprobs=self._chat_logprobs(c.tokens),
                    finish_reason=c.finish_reason,
                )
                for c in choices
            ],
            usage=usage,
        )

    def _chat_logprobs(self, tokens: list[TokenOut]) -> Optional[ChatLogprobs]:
        if not self._logprobs:
            return None
        return ChatLogprobs(content=[self._token_logprob(t.token_id, t.logprob) for t in tokens])

    def _token_logprob(self, token_id: int, logprob: TokenLogprob) -> ChatTokenLogprob:
        return ChatTokenLogprob(
            token=self._strings.text(token_id),
            logprob=logprob.logprob,
            bytes=self._strings.bytes(token_id),
            top_logprobs=[
                TopLogprob(token=self._strings.text(i), logprob=lp, bytes=self._strings.bytes(i))
                for i, lp in logprob.top
            ],
        )
