"""Tool calls of chat completions: grammars for forced calls, and parsers of a model's own format.

`tool_choice` decides how calls come out of the generated text:
  * `required` / a named function: decoding is constrained to `required_schema` / `named_schema`
    and `RequiredCallStream` / `NamedCallStream` read the calls from the constrained text;
  * `auto`: the model writes calls in its own format, read by `ToolCallStream(parser)`: "hermes"
    (`<tool_call>{json}</tool_call>` blocks: Hermes, Qwen2.5, Qwen3) or "llama3_json" (the whole
    output is `{"name": ..., "parameters": ...}` objects separated by ";": Llama 3.1 / 3.2); gpt-oss's
    messages ("harmony") are read by serve_app.text.harmony, with their reasoning.

Every stream turns text deltas into `StreamEvent`s: content text (`delta.content`) or a
`ToolCallDelta` (one `delta.tool_calls` item). Invariants of every stream, for any split of a text:
  * the content events concatenate to the text outside calls, verbatim, or to "" when that text is
    whitespace only (a non-streamed response then has content null);
  * a call's first delta carries index, id and name with arguments ""; its later deltas carry only
    arguments fragments, which concatenate to the JSON text of an object;
  * the non-streamed results (`parse_tool_calls`, `calls_from_required`) are the same stream run
    over the whole text, so streamed and non-streamed responses cannot disagree.
Text the auto parsers cannot read as calls (invalid JSON, an unclosed block) is content, never
dropped and never an error.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Optional, Union

PARSERS = ("hermes", "llama3_json")
"""Names of the tool-call formats `ToolCallStream` reads (`tool_choice: auto`)."""
PARSER_TAGS = {"hermes": ("<tool_call>", "</tool_call>"), "llama3_json": ("<|python_tag|>",)}
"""The markup each format reads; where a tokenizer makes it a special token, the detokenizer keeps it."""


@dataclass
class ToolCall:
    """One call of an assistant message; `arguments` is the JSON text of an object, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        """The `message.tool_calls` item of a non-streamed response."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """One `delta.tool_calls` item of a streamed chunk: id and name are set on a call's first delta only."""

    index: int
    id: Optional[str]
    name: Optional[str]
    arguments: str

    def to_openai(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


StreamEvent = Union[str, ToolCallDelta]
"""Content text, or a tool-call delta."""


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _dumps(arguments: dict) -> str:
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


# ---- grammars for tool_choice `required` and a named function -----------------------------------


def named_schema(parameters: Optional[dict]) -> dict:
    """The schema of a named function's output: its arguments object (any object when it declares
    no parameters, as OpenAI treats such a function)."""
    return dict(parameters) if parameters else {"type": "object"}


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """The schema of `tool_choice: required`: an array of one or more (one, unless `parallel`)
    `{"name": <a declared tool>, "parameters": <its arguments>}` objects. `$defs` of the tools'
    parameters move to the root (renamed per tool), so their `$ref`s still resolve."""
    if not tools:
        raise ValueError("tool_choice 'required' needs at least one function in 'tools'")
    defs: dict = {}
    calls = []
    for tool in tools:
        function = tool["function"]
        parameters = _hoist_defs(named_schema(function.get("parameters")), function["name"] + ".", defs)
        calls.append({
            "type": "object",
            "properties": {"name": {"const": function["name"]}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


_DEFS_KEYS = ("$defs", "definitions")


def _hoist_defs(schema: dict, prefix: str, defs: dict) -> dict:
    """`schema` without its top-level definitions, which go to `defs` as prefix + name; its local
    `$ref`s are rewritten to point there."""

    def rewrite(node):
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        if not isinstance(node, dict):
            return node
        return {key: _moved_ref(value, prefix) if key == "$ref" else rewrite(value) for key, value in node.items()}

    for key in _DEFS_KEYS:
        for name, definition in schema.get(key, {}).items():
            defs[prefix + name] = rewrite(definition)
    return rewrite({key: value for key, value in schema.items() if key not in _DEFS_KEYS})


def _moved_ref(ref, prefix: str):
    for key in _DEFS_KEYS:
        if isinstance(ref, str) and ref.startswith(f"#/{key}/"):
            return f"#/$defs/{prefix}{ref[len(key) + 3:]}"
    return ref


def calls_from_required(text: str) -> list[ToolCall]:
    """The calls of a complete `required_schema` output (an unclosed last object, cut by the length
    limit, is no call)."""
    return _collect(RequiredCallStream(), text)[1]


def call_from_named(name: str, text: str) -> ToolCall:
    """The call of a `named_schema` output: the text is its arguments, as generated."""
    return ToolCall(new_call_id(), name, text)


# ---- streams -------------------------------------------------------------------------------------


class CallStream:
    """Text deltas in, `StreamEvent`s out: `push` each delta, then `finish` once."""

    def __init__(self):
        self._calls = 0
        self._spoke = False  # some non-whitespace content has gone out
        self._blank = ""  # whitespace content held until non-whitespace content follows

    def push(self, delta: str) -> list[StreamEvent]:
        raise NotImplementedError

    def finish(self) -> list[StreamEvent]:
        return []

    def _content(self, text: str) -> list[StreamEvent]:
        if self._spoke or not text:
            return [text] if text else []
        self._blank += text
        if self._blank.isspace():
            return []
        self._spoke = True
        text, self._blank = self._blank, ""
        return [text]

    def _call(self, name: str, arguments: str) -> list[StreamEvent]:
        index, self._calls = self._calls, self._calls + 1
        return [ToolCallDelta(index, new_call_id(), name, ""), ToolCallDelta(index, None, None, arguments)]


class NamedCallStream(CallStream):
    """The constrained output of a named function: a header delta, then the text as arguments
    (whitespace before the object, which a reasoning model's grammar allows after its thinking,
    left out)."""

    def __init__(self, name: str):
        super().__init__()
        self._header: Optional[ToolCallDelta] = ToolCallDelta(0, new_call_id(), name, "")
        self._started = False

    def push(self, delta: str) -> list[StreamEvent]:
        if not self._started:
            delta = delta.lstrip()
            self._started = bool(delta)
        return self.finish() + ([ToolCallDelta(0, None, None, delta)] if delta else [])

    def finish(self) -> list[StreamEvent]:
        """The header, unless it went out already (so an empty output still makes one call)."""
        header, self._header = self._header, None
        return [header] if header else []


class RequiredCallStream(CallStream):
    """The constrained output of `tool_choice: required`: each call goes out when its object closes."""

    def __init__(self):
        super().__init__()
        self._depth = 0  # of brackets and braces outside strings; the array is depth 1
        self._in_string = False
        self._escaped = False  # the previous character was a backslash inside a string
        self._object: list[str] = []  # characters of the call object being read

    def push(self, delta: str) -> list[StreamEvent]:
        events = []
        for char in delta:
            before = self._depth
            self._scan(char)
            if max(before, self._depth) >= 2:
                self._object.append(char)
            if before == 2 and self._depth == 1:
                events += self._call_of("".join(self._object))
                self._object = []
        return events

    def _scan(self, char: str) -> None:
        if self._escaped:
            self._escaped = False
        elif self._in_string:
            self._escaped = char == "\\"
            self._in_string = char != '"'
        elif char == '"':
            self._in_string = True
        elif char in "[{":
            self._depth += 1
        elif char in "]}":
            self._depth -= 1

    def _call_of(self, text: str) -> list[StreamEvent]:
        call = _as_call(_loads(text), ("parameters",))
        if call is None:
            raise ValueError(f"not a call object of required_schema (was decoding constrained?): {text!r}")
        return self._call(*call)


class ToolCallStream(CallStream):
    """A model's own tool-call format (`tool_choice: auto`), read by the parser named `parser`."""

    def __init__(self, parser: str):
        super().__init__()
        if parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r}; use one of {', '.join(PARSERS)}")
        self._parser = _HermesStream() if parser == "hermes" else _Llama3Stream()

    def push(self, delta: str) -> list[StreamEvent]:
        return self._parser.push(delta)

    def finish(self) -> list[StreamEvent]:
        return self._parser.finish()


class _HermesStream(CallStream):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among content. Content is
    held back only while it ends with a prefix of the open tag, a block until it closes."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self._buffer = ""  # unsent text: after the last tag, or a partial open tag
        self._inside = False

    def push(self, delta: str) -> list[StreamEvent]:
        self._buffer += delta
        events = []
        while (at := self._buffer.find(tag := self.CLOSE if self._inside else self.OPEN)) >= 0:
            text, self._buffer = self._buffer[:at], self._buffer[at + len(tag):]
            events += self._block(text, closed=True) if self._inside else self._content(text)
            self._inside = not self._inside
        if not self._inside:
            sent = len(self._buffer) - _partial_suffix(self._buffer, self.OPEN)
            events += self._content(self._buffer[:sent])
            self._buffer = self._buffer[sent:]
        return events

    def finish(self) -> list[StreamEvent]:
        text, self._buffer = self._buffer, ""
        return self._block(text, closed=False) if self._inside else self._content(text)

    def _block(self, body: str, closed: bool) -> list[StreamEvent]:
        """A block's events; an unclosed one (the model stopped after its JSON) is read the same."""
        call = _as_call(_loads(body), ("arguments", "parameters"))
        if call is not None:
            return self._call(*call)
        return self._content(self.OPEN + body + (self.CLOSE if closed else ""))


class _Llama3Stream(CallStream):
    """The whole output is `{"name": ..., "parameters": {...}}` objects separated by ";", optionally
    after `<|python_tag|>`. An output that starts like that is held back to the end and read then;
    any other output is content as it comes."""

    TAG = "<|python_tag|>"

    def __init__(self):
        super().__init__()
        self._buffer = ""
        self._held: Optional[bool] = None  # None until the first non-space characters decide

    def push(self, delta: str) -> list[StreamEvent]:
        if self._held is False:
            return self._content(delta)
        self._buffer += delta
        head = self._buffer.lstrip()
        if head.startswith(("{", self.TAG)):
            self._held = True
        elif head and not self.TAG.startswith(head):
            self._held = False
            text, self._buffer = self._buffer, ""
            return self._content(text)
        return []

    def finish(self) -> list[StreamEvent]:
        text, self._buffer = self._buffer, ""
        calls = _llama3_calls(text) if self._held else None
        if not calls:
            return self._content(text)
        return [event for call in calls for event in self._call(*call)]


_SPACE = re.compile(r"\s*")


def _llama3_calls(text: str) -> Optional[list[tuple[str, str]]]:
    """The calls of a whole Llama 3 output, or None unless all of it is calls."""
    body = text.strip().removeprefix(_Llama3Stream.TAG)
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, _SPACE.match(body, at).end())
        except ValueError:
            return None
        call = _as_call(value, ("parameters", "arguments"))
        at = _SPACE.match(body, at).end()
        if call is None or (at < len(body) and body[at] != ";"):
            return None
        calls.append(call)
        at += 1
    return calls


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _as_call(value, argument_keys: tuple[str, ...]) -> Optional[tuple[str, str]]:
    """(name, arguments JSON) of a `{"name": ..., <argument key>: {...}}` object, else None. Missing
    arguments are `{}`; arguments given as the JSON text of an object are accepted too."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = next((value[key] for key in argument_keys if key in value), {})
    if isinstance(arguments, str):
        arguments = _loads(arguments)
    return (value["name"], _dumps(arguments)) if isinstance(arguments, dict) else None


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


# ---- non-streamed responses and defaults ---------------------------------------------------------


def parse_tool_calls(parser: str, text: str) -> tuple[Optional[str], list[ToolCall]]:
    """(content, calls) of a whole `tool_choice: auto` output; content is None when whitespace only."""
    return _collect(ToolCallStream(parser), text)


def _collect(stream: CallStream, text: str) -> tuple[Optional[str], list[ToolCall]]:
    content, calls = [], {}
    for event in stream.push(text) + stream.finish():
        if isinstance(event, str):
            content.append(event)
        elif event.id is not None:
            calls[event.index] = ToolCall(event.id, event.name, event.arguments)
        else:
            calls[event.index].arguments += event.arguments
    return "".join(content) or None, [calls[index] for index in sorted(calls)]


def default_parser(chat_template: Optional[str]) -> str:
    """The parser matching the tool-call format a chat template teaches: "harmony" for gpt-oss's
    (serve_app.text.harmony), "llama3_json" for Llama 3.1 / 3.2 templates, otherwise "hermes"
    (ChatML templates with `<tool_call>`, the common default)."""
    template = chat_template or ""
    if "<|channel|>" in template:
        return "harmony"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "dictionary of argument name and its value" in template:
        return "llama3_json"
    return "hermes"
