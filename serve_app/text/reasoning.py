"""Reasoning models' thinking, split from their answer: `message.reasoning_content` / streamed
`delta.reasoning_content`, and `content` without it.

Qwen3 and DeepSeek-R1 style models think inside `<think> ... </think>` before they answer. Their
chat templates differ in where the opening tag goes: Qwen3's model writes it itself (and with
`enable_thinking: false` the template closes an empty block in the prompt), DeepSeek-R1's template
ends the prompt with it. So the reader starts inside the block exactly when the rendered prompt
leaves one open (`opened_by`), whichever the family. gpt-oss thinks in a channel of its own
messages instead: serve_app.text.harmony reads those.

Invariants of `ReasoningStream`, for any split of a text into pushes:
  * the reasoning events concatenate to the text between the opening tag (or the start, when the
    prompt opened the block) and the first closing tag, without the tags;
  * the content events concatenate to the text before an opening tag that starts the output
    (whitespace only) and everything after the closing tag, verbatim;
  * an output that never closes its block is reasoning only (a length cut mid-thought);
  * the non-streamed result is the same stream run over the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.generate.grammar import after_prefix
from engine.generate.request import Grammar

PARSERS = ("qwen3", "deepseek_r1")
"""Names of the reasoning formats (vLLM's); both read `<think> ... </think>`."""
OPEN, CLOSE = "<think>", "</think>"
TAGS = (OPEN, CLOSE)
"""The markup read; where a tokenizer makes it a special token, the detokenizer keeps it."""


@dataclass(frozen=True)
class Thought:
    """A piece of reasoning text (`delta.reasoning_content`)."""

    text: str


HARMONY_MARK = "<|channel|>"
"""What a chat template of gpt-oss's format writes (serve_app.text.harmony reads that format)."""


def default_parser(chat_template: str | None) -> str | None:
    """The format a chat template's model thinks in: "harmony" where it writes harmony's channels
    (gpt-oss), "qwen3" where it closes a `<think>` block, else None."""
    if chat_template and HARMONY_MARK in chat_template:
        return "harmony"
    return "qwen3" if chat_template and CLOSE in chat_template else None


def opened_by(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a `<think>` block open for the output to continue."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


def closed_by(prompt_text: str) -> bool:
    """Whether the rendered prompt ends on a closed block (Qwen3's `enable_thinking: false`): the
    model answers at once."""
    return prompt_text.rstrip().endswith(CLOSE)


def after_thinking(grammar: Optional[Grammar], prompt_text: str) -> tuple[Optional[Grammar], bool]:
    """(the constraint of a reasoning model's output, whether the output starts inside a block).

    A JSON schema or regular expression constrains the answer only: the grammar lets the thinking
    (any text up to `</think>`; opened by the prompt, or optionally by the model) and whitespace
    come first. Where the prompt closed the block, or the constraint is a Lark grammar (which
    cannot be nested), it applies from the first token and the output is all answer."""
    inside = opened_by(prompt_text)
    if grammar is None:
        return None, inside
    answer = after_prefix(grammar, CLOSE, None if inside else OPEN)
    if answer is None or closed_by(prompt_text):
        return grammar, False
    return answer, inside


class ReasoningStream:
    """Splits a choice's text deltas into `Thought`s and content text (str), in order."""

    def __init__(self, inside: bool):
        self._state = "thinking" if inside else "start"  # start -> thinking -> answer
        self._held = ""  # text that may be the start of a tag, not yet given out
        self.thought = inside
        """Whether the output has a reasoning block (empty or not)."""

    @property
    def answering(self) -> bool:
        """Whether the reasoning block has closed (what follows is the answer)."""
        return self._state == "answer"

    def push(self, text: str) -> list[Thought | str]:
        events: list[Thought | str] = []
        text, self._held = self._held + text, ""
        while text:
            if self._state == "answer":
                events.append(text)
                break
            if self._state == "start":
                text = self._start(text, events)
            else:
                text = self._think(text, events)
        return [e for e in events if (e.text if isinstance(e, Thought) else e)]

    def finish(self) -> list[Thought | str]:
        """The text held back at the end: what it is, now that no tag can complete."""
        held, self._held = self._held, ""
        if not held:
            return []
        return [Thought(held)] if self._state == "thinking" else [held]

    def _start(self, text: str, events: list) -> str:
        """Before anything but whitespace: an opening tag starts the reasoning; other text is an
        answer without reasoning."""
        stripped = text.lstrip()
        lead = text[: len(text) - len(stripped)]
        if stripped.startswith(OPEN):
            self._state, self.thought = "thinking", True
            return stripped[len(OPEN):]
        if not stripped or OPEN.startswith(stripped):  # whitespace, or a tag still arriving
            self._held = text
            return ""
        self._state = "answer"
        events.append(lead + stripped)
        return ""

    def _think(self, text: str, events: list) -> str:
        end = text.find(CLOSE)
        if end >= 0:
            events.append(Thought(text[:end]))
            self._state = "answer"
            return text[end + len(CLOSE):]
        keep = _partial_suffix(text, CLOSE)
        events.append(Thought(text[: len(text) - keep]))
        self._held = text[len(text) - keep:]
        return ""


def split_reasoning(text: str, inside: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output: `ReasoningStream` over it at once."""
    stream = ReasoningStream(inside)
    events = stream.push(text) + stream.finish()
    thoughts = [e.text for e in events if isinstance(e, Thought)]
    content = "".join(e for e in events if isinstance(e, str))
    return ("".join(thoughts) if stream.thought else None), content


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
