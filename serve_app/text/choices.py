"""One choice's output: the token deltas of its engine request read into `ChoiceUpdate`s.

`ChoiceReader` decodes the tokens incrementally (serve_app.text.detokenize), cuts the text at the
first stop string, puts the echoed prompt first when asked, and routes a reasoning model's
thinking into `reasoning` (serve_app.text.reasoning) and a chat's tool calls into `tool_calls`
(serve_app.text.tool_calls); the rest is `text`. A gpt-oss chat's channels are read by one
reader, serve_app.text.harmony, that makes all three.

Invariants: the updates of a choice concatenate to its whole output; the last one, and only it,
has the finish reason and the counts; an update with nothing to send is not made.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from engine.generate.request import TokenDelta
from serve_app.text.detokenize import TextStream
from serve_app.text.reasoning import ReasoningStream, Thought
from serve_app.text.responses import ChoiceCounts, ChoiceUpdate, TokenOut
from serve_app.text.tokenizer import PromptInput
from serve_app.text.tool_calls import CallStream, ToolCallDelta


@dataclasses.dataclass(frozen=True)
class OutputRules:
    """What a request asks of each of its choices' output."""

    stops: list[str]
    echo: bool
    drop_output: bool
    """max_tokens=0: the one token the engine must make is not part of the answer."""
    logprobs: bool
    keep_special: frozenset[int] = frozenset()
    """Special tokens the text keeps (the tool-call and reasoning parsers' tags)."""
    calls: Optional[Callable[[], CallStream]] = None
    """Chat with tools: makes each choice's reader of tool calls out of its text (a harmony chat's,
    tools or not: its reader of thinking, answer and calls)."""
    reasoning: Optional[Callable[[], ReasoningStream]] = None
    """A reasoning model's chat: makes each choice's reader of its thinking."""


class ChoiceReader:
    """Reads the token deltas of choice `index` (one engine request) into its updates."""

    def __init__(self, tokenizer, index: int, prompt: PromptInput, rules: OutputRules):
        self.index, self._prompt, self._rules = index, prompt, rules
        self._echo_text, self._echo_offsets = echo_text(tokenizer, prompt) if rules.echo else ("", [])
        self._text = TextStream(tokenizer, prompt.ids, rules.stops, start_offset=len(self._echo_text),
                                keep_special=rules.keep_special)
        self._calls = rules.calls() if rules.calls is not None else None
        self._thinking = rules.reasoning() if rules.reasoning is not None else None
        self._called = False
        self.counts = ChoiceCounts(0, 0, 0)
        self.reason: Optional[str] = None
        """The finish reason, once the choice has ended (its last update is made)."""

    def read(self, delta: TokenDelta) -> Optional[ChoiceUpdate]:
        """The update `delta` makes (None: nothing to send yet)."""
        update = ChoiceUpdate(self.index)
        if delta.num_prompt_tokens:  # the first delta
            self.counts = ChoiceCounts(delta.num_prompt_tokens, 0, delta.num_cached_tokens)
            if self._rules.echo:
                update.extend(self._echo_update(delta))
        token_ids = [] if self._rules.drop_output else delta.token_ids
        new_text, offsets = self._text.push(token_ids)
        logprobs = delta.logprobs or [None] * len(token_ids)
        update.tokens += [TokenOut(*t) for t in zip(token_ids, logprobs, offsets)]
        self.counts.completion_tokens += len(token_ids)
        ending = self._text.stopped or delta.finished
        if delta.finished and not self._text.stopped:
            new_text += self._text.finish()
        self._route(update, new_text, ending)
        if ending:
            reason = "stop" if self._text.stopped else delta.finish_reason.value
            self.reason = "tool_calls" if self._called and reason == "stop" else reason
            update.finish_reason, update.counts = self.reason, self.counts
            return update
        if update.text or update.reasoning or update.tool_calls or (self._rules.logprobs and update.tokens):
            return update
        return None

    def _route(self, update: ChoiceUpdate, text: str, ending: bool) -> None:
        """New text through the reasoning reader, then the tool-call reader, into `update`."""
        if self._thinking is not None:
            text = _read_thoughts(update, self._thinking, text, ending)
        if self._calls is None:
            update.text += text
        else:
            self._called |= _read_calls(update, self._calls, text, ending)

    def _echo_update(self, delta: TokenDelta) -> ChoiceUpdate:
        logprobs = delta.prompt_logprobs or [None] * len(self._echo_offsets)
        tokens = [TokenOut(*t) for t in zip(self._prompt.ids, logprobs, self._echo_offsets)]
        return ChoiceUpdate(self.index, self._echo_text, tokens)


def echo_text(tokenizer, prompt: PromptInput) -> tuple[str, list[int]]:
    """The echoed prompt text and each prompt token's offset in it."""
    stream = TextStream(tokenizer)
    text, offsets = stream.push(prompt.ids)
    text += stream.finish()
    return (prompt.text if prompt.text is not None else text), offsets


def _read_thoughts(update: ChoiceUpdate, thinking: ReasoningStream, text: str, ending: bool) -> str:
    """Route a choice's new text through its reasoning reader: thinking into `update`, the answer's
    text returned."""
    events = thinking.push(text) + (thinking.finish() if ending else [])
    update.reasoning += "".join(e.text for e in events if isinstance(e, Thought))
    return "".join(e for e in events if isinstance(e, str))


def _read_calls(update: ChoiceUpdate, calls: CallStream, text: str, ending: bool) -> bool:
    """Route a choice's new text through its tool-call reader into `update` (thinking too, which
    the harmony reader finds); True if a call began."""
    events = calls.push(text) + (calls.finish() if ending else [])
    update.text += "".join(e for e in events if isinstance(e, str))
    update.reasoning += "".join(e.text for e in events if isinstance(e, Thought))
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    update.tool_calls += deltas
    return bool(deltas)
