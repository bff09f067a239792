"""gpt-oss's chat format ("harmony"): a model's output read into reasoning, content and tool calls.

A harmony model answers in messages. Its chat template ends the prompt with `<|start|>assistant`, so
the output opens with the rest of a header (shown on two lines; the real output has no newline):

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>

A header is `[ROLE][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ [<|constrain|>]TYPE]`; the body
after `<|message|>` runs to `<|end|>` (more messages follow, each after `<|start|>`), `<|return|>`
(the answer is done) or `<|call|>` (a tool call waits for its result). Where a body goes:
  * a recipient `functions.NAME` (on any channel; with the request's tools only): a call of NAME,
    the body its arguments (a JSON object);
  * channel `analysis`: reasoning (`Thought`);
  * `final`, `commentary` without a recipient (a preamble to calls), any other channel or none:
    content.

The markup tokens (TAGS) are special tokens of the model's tokenizer; the detokenizer keeps them for
this reader, which lets none of them through into reasoning, content or arguments.

Invariants of `HarmonyStream`, for any split of a text into pushes:
  * reasoning and content are the bodies of their messages, verbatim, joined by "\\n" where one of
    them gets the text of more than one message; they stream as the bodies arrive;
  * a call goes out whole when its message ends (at its closing tag or at the end of the output):
    its header delta, then its arguments as compact JSON;
  * what cannot be read as harmony is content: text where a header should be that never reaches
    `<|message|>` and has no markup (a model that ignores the format), a message on an unknown
    channel or none, a call whose body is not a JSON object; a header cut short (it has markup, or
    follows `<|start|>`; a length cut) has no text to show and shows none;
  * the non-streamed result is the same stream run over the whole text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional, Union

from serve_app.text.reasoning import Thought
from serve_app.text.tool_calls import CallStream, ToolCallDelta

PARSER = "harmony"
"""The name of the format, as `reasoning_parser` and `tool_call_parser` (one reader serves both)."""
START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
TAGS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
"""The markup read; a harmony tokenizer makes each a special token, which the detokenizer keeps."""
CLOSERS = (END, RETURN, CALL, START)
"""Tags that end a body (or a header cut short) and are consumed; the other tags begin the next header."""
FUNCTIONS = "functions."
_LONGEST = max(len(tag) for tag in TAGS)
_CHANNEL_NAME = re.compile(r"[^\s<]*")
_ANY_TAG = re.compile("|".join(re.escape(tag) for tag in TAGS))

HarmonyEvent = Union[Thought, str, ToolCallDelta]


@dataclass(frozen=True)
class Header:
    """What a message header says that decides where its body goes."""

    channel: Optional[str]
    recipient: Optional[str]


def parse_header(text: str) -> Header:
    """The channel (the word after `<|channel|>`) and recipient (`to=...`, before or after the
    channel) of a header's text; a role and a content type are read past."""
    channel = None
    at = text.find(CHANNEL)
    if at >= 0:
        rest = text[at + len(CHANNEL):]
        name = _CHANNEL_NAME.match(rest).group()
        channel = name or None
        text = f"{text[:at]} {rest[len(name):]}"
    words = text.replace(CONSTRAIN, " ").split()
    recipient = next((word[len("to="):] for word in words if word.startswith("to=")), None)
    return Header(channel, recipient)


class HarmonyStream(CallStream):
    """Splits a choice's text deltas into `Thought`s, content text (str) and `ToolCallDelta`s, in
    order. `calls`: the request offered tools (else a call's body is content); `thinking`: analysis
    goes to reasoning (else to content, as `reasoning_parser: none` asks)."""

    def __init__(self, calls: bool = True, thinking: bool = True):
        super().__init__()
        self._calls_on, self._thinking = calls, thinking
        self._buffer = ""  # text not read yet: a header until its end, or the body's possible partial tag
        self._scanned = 0  # reading a header: no tag ends before buffer[_scanned:] begins
        self._kind: Optional[str] = None  # the open body's destination: thought, content or call; None: a header
        self._name = ""  # the function an open call body calls
        self._arguments = ""  # an open call's body, read whole when its message ends
        self._fresh = False  # the open body has sent no text yet
        self._opened = False  # the header being read follows `<|start|>`
        self._filled: set[str] = set()  # the destinations that earlier messages sent text to

    def push(self, delta: str) -> list[HarmonyEvent]:
        self._buffer += delta
        events: list[HarmonyEvent] = []
        while self._read_header(events) if self._kind is None else self._read_body(events):
            pass
        return events

    def finish(self) -> list[HarmonyEvent]:
        """The output ended: a header still open is read as one that never closes; an open body is
        read to its end."""
        text, self._buffer = self._buffer, ""
        if self._kind is None:
            return self._stray(text)
        return self._send(text) + self._close()

    def _read_header(self, events: list) -> bool:
        """Reads a header up to the tag that ends it; False while none has arrived."""
        at, tag = _first_tag(self._buffer, (MESSAGE, *CLOSERS), self._scanned)
        if tag is None:
            self._scanned = max(0, len(self._buffer) - _LONGEST + 1)
            return False
        header, self._buffer, self._scanned = self._buffer[:at], self._buffer[at + len(tag):], 0
        if tag == MESSAGE:
            self._open(parse_header(header))
        else:
            events += self._stray(header)
        self._opened = tag == START
        return True

    def _read_body(self, events: list) -> bool:
        """Sends a body's text up to its closing tag, holding back only what may begin a tag."""
        at, tag = _first_tag(self._buffer, TAGS)
        if tag is None:
            sent = len(self._buffer) - _partial_tag(self._buffer)
            events += self._send(self._buffer[:sent])
            self._buffer = self._buffer[sent:]
            return False
        events += self._send(self._buffer[:at])
        self._buffer = self._buffer[at + len(tag):] if tag in CLOSERS else self._buffer[at:]
        self._opened = tag == START
        events += self._close()
        return True

    def _stray(self, header: str) -> list[HarmonyEvent]:
        """A header that never reached `<|message|>`: plain text (a model ignoring the format, or text
        between messages) is content, as a message of its own unless blank; a header cut short
        (markup, or after `<|start|>`) shows nothing."""
        if not header or self._opened or _ANY_TAG.search(header):
            return []
        if header.isspace():
            return self._content(header)
        self._fresh = True
        return self._text("content", header)

    def _open(self, header: Header) -> None:
        recipient = header.recipient or ""
        if self._calls_on and recipient.startswith(FUNCTIONS) and len(recipient) > len(FUNCTIONS):
            self._kind, self._name = "call", recipient[len(FUNCTIONS):]
        elif header.channel == "analysis" and self._thinking:
            self._kind = "thought"
        else:
            self._kind = "content"
        self._fresh = True

    def _send(self, text: str) -> list[HarmonyEvent]:
        if not text:
            return []
        if self._kind == "call":
            self._arguments += text
            return []
        return self._text(self._kind, text)

    def _text(self, kind: str, text: str) -> list[HarmonyEvent]:
        """A body's text to its destination, after "\\n" where an earlier message's text went there."""
        if self._fresh:
            self._fresh = False
            text = "\n" + text if kind in self._filled else text
            self._filled.add(kind)
        return [Thought(text)] if kind == "thought" else self._content(text)

    def _close(self) -> list[HarmonyEvent]:
        """The open message ends: a call's body is read now (content unless a JSON object)."""
        kind, self._kind = self._kind, None
        if kind != "call":
            return []
        arguments, self._arguments = self._arguments, ""
        value = _json(arguments)
        if isinstance(value, dict):
            return self._call(self._name, json.dumps(value, ensure_ascii=False, separators=(",", ":")))
        return self._text("content", arguments) if arguments else []


def split_harmony(text: str, calls: bool = True, thinking: bool = True) -> list[HarmonyEvent]:
    """The events of a whole output: `HarmonyStream` over it at once."""
    stream = HarmonyStream(calls, thinking)
    return stream.push(text) + stream.finish()


def _first_tag(text: str, tags: tuple[str, ...], start: int = 0) -> tuple[int, Optional[str]]:
    """(where, which) of the first of `tags` in text[start:]; (-1, None) if none is there."""
    hits = [(at, tag) for tag in tags if (at := text.find(tag, start)) >= 0]
    return min(hits) if hits else (-1, None)


def _partial_tag(text: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of a tag."""
    for size in range(min(len(text), _LONGEST - 1), 0, -1):
        if any(tag.startswith(text[-size:]) for tag in TAGS):
            return size
    return 0


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None
