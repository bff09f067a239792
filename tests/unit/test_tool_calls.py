"""serve_app.text.tool_calls: the auto parsers (hermes, llama3_json), streamed and not, the grammars and
streams of tool_choice `required` / a named function, and the default parser of a chat template."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from serve_app.text.tool_calls import (
    NamedCallStream,
    RequiredCallStream,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    call_from_named,
    calls_from_required,
    default_parser,
    named_schema,
    new_call_id,
    parse_tool_calls,
    required_schema,
)
from tests.support.harmony_models import HARMONY_TEMPLATE


def parsed(parser: str, text: str):
    """`parse_tool_calls` with the random ids left out: (content, [(name, arguments)])."""
    content, calls = parse_tool_calls(parser, text)
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call.id) for call in calls)
    return content, [(call.name, call.arguments) for call in calls]


def assemble(events) -> tuple[str, list[tuple[str, str]]]:
    """Joined content and (name, arguments) per call of a stream's events, checking the delta shape:
    indices 0, 1, ... in order; a call's first delta has id, name, arguments ""; later ones neither."""
    content, calls = "", []
    for event in events:
        if isinstance(event, str):
            assert event
            content += event
        elif event.id is not None:
            assert (event.index, event.arguments) == (len(calls), "") and event.name
            calls.append([event.name, ""])
        else:
            assert event.index == len(calls) - 1 and event.name is None
            calls[-1][1] += event.arguments
    return content, [tuple(call) for call in calls]


def streamed(stream, pieces) -> tuple[str, list[tuple[str, str]]]:
    events = [event for piece in pieces for event in stream.push(piece)] + stream.finish()
    return assemble(events)


def call(name: str, **arguments) -> str:
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


# ---- hermes --------------------------------------------------------------------------------------

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (WEATHER, None, [("get_weather", '{"city":"Paris","unit":"C"}')]),
        (
            f"Let me check both.\n<tool_call>\n{call('a', x=1)}\n</tool_call>\n<tool_call>\n{call('b')}\n</tool_call>",
            "Let me check both.\n\n",
            [("a", '{"x":1}'), ("b", "{}")],
        ),
        ("Plain answer, a < b and <tool but no call.", "Plain answer, a < b and <tool but no call.", []),
        (f"\n{WEATHER}\n\n", None, [("get_weather", '{"city":"Paris","unit":"C"}')]),
        (f"Before{WEATHER}after.", "Beforeafter.", [("get_weather", '{"city":"Paris","unit":"C"}')]),
        (  # unicode, kept as is in the arguments
            f"<tool_call>{call('translate', text='Zürich — 東京 🚀', to='ελληνικά')}</tool_call>",
            None,
            [("translate", '{"text":"Zürich — 東京 🚀","to":"ελληνικά"}')],
        ),
        (  # braces, quotes and a closing-tag prefix inside strings; nested objects
            '<tool_call>{"name": "run", "arguments": {"code": "if (a) { b(\\"}\\"); } </tool_c", '
            '"opts": {"deep": [1, {"x": null, "y": [true, 2.5]}]}}}</tool_call>',
            None,
            [("run", '{"code":"if (a) { b(\\"}\\"); } </tool_c","opts":{"deep":[1,{"x":null,"y":[true,2.5]}]}}')],
        ),
        (  # arguments as the JSON text of an object; "parameters" as the key
            '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
            '<tool_call>{"name": "g", "parameters": {"b": 2}}</tool_call>',
            None,
            [("f", '{"a":1}'), ("g", '{"b":2}')],
        ),
        # an unclosed last block (the model stopped after its JSON) is a call when its JSON is one
        (f"Hi <tool_call>\n{call('f', a=[1])}\n", "Hi ", [("f", '{"a":[1]}')]),
    ],
)
def test_hermes(text, content, calls):
    assert parsed("hermes", text) == (content, calls)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # invalid JSON
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>["f"]</tool_call>',
        "<tool_call></tool_call>",
        'Text <tool_call>{"name": "f", "arguments": {"a": ',  # cut off inside an unclosed block
        "Ends with an open tag <tool_call>",
        "Ends with half a tag <tool_c",
    ],
)
def test_hermes_keeps_what_is_not_a_call_as_content(text):
    assert parsed("hermes", text) == (text, [])


def test_hermes_invalid_block_among_valid_ones():
    bad = "<tool_call>{oops}</tool_call>"
    text = f"{WEATHER}\n{bad}\n<tool_call>{call('b', y='z')}</tool_call>"
    assert parsed("hermes", text) == (f"\n{bad}\n", [("get_weather", '{"city":"Paris","unit":"C"}'), ("b", '{"y":"z"}')])


# ---- llama3_json ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city":"Paris"}')]),
        (
            '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}};\n',
            None,
            [("a", '{"x":1}'), ("b", "{}")],
        ),
        (
            '\n\n {"name": "s", "parameters": {"q": "}; {\\"name\\": \\"x\\"}", "n": {"m": ["é", "中"]}}}',
            None,
            [("s", '{"q":"}; {\\"name\\": \\"x\\"}","n":{"m":["é","中"]}}')],
        ),
        ('{"name": "now"}', None, [("now", "{}")]),
    ],
)
def test_llama3_json(text, content, calls):
    assert parsed("llama3_json", text) == (content, calls)


@pytest.mark.parametrize(
    "text",
    [
        "The answer is {x} where x = 2.",
        'Sure: {"name": "f", "parameters": {}}',  # a call after text is not this format
        '{"not": "a call"}',
        '{"name": "f", "parameters": {}} and then some text',
        '{"name": "f", "parameters": {}}; {"name": "g", "parameters": ',  # cut off
        '{"name": "f", "parameters": {"a": 1}',
        '<|python_tag|>brave_search.call(query="weather in Paris")',
        "<|python_tag|>",
        "<|pyth",
        "  {",
    ],
)
def test_llama3_json_keeps_what_is_not_a_call_as_content(text):
    assert parsed("llama3_json", text) == (text, [])


def test_whitespace_only_content_is_none():
    assert parsed("hermes", " \n\t") == (None, [])
    assert parsed("llama3_json", "\n\n") == (None, [])
    assert parse_tool_calls("hermes", "") == (None, [])


def test_unknown_parser_says_which_exist():
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        ToolCallStream("mistral")


# ---- streaming -----------------------------------------------------------------------------------

BRACES = call("b", s='}{ é "')
SPLIT_TEXTS = [
    ("hermes", f"Let me look.\n{WEATHER}\n<tool_call>{BRACES}</tool_call> done"),
    ("hermes", f"\n\n{WEATHER}\n"),
    ("hermes", "a <tool_call>{bad json}</tool_call> b <tool_c"),
    ("hermes", "x < y <tool_call>"),
    ("hermes", f"<tool_call>{call('f', a={'b': '</tool_call'})}"),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": "{;}"}};{"name": "b", "parameters": {}}'),
    ("llama3_json", ' {"name": "f", "parameters": {"a": 1}} trailing'),
    ("llama3_json", " <b>Hello</b> {not json}"),
    ("llama3_json", "\n \n"),
]


def expected(parser: str, text: str):
    content, calls = parsed(parser, text)
    return content or "", calls


@pytest.mark.parametrize("parser, text", SPLIT_TEXTS)
def test_every_split_point_gives_the_non_streamed_result(parser, text):
    want = expected(parser, text)
    for at in range(len(text) + 1):
        assert streamed(ToolCallStream(parser), [text[:at], text[at:]]) == want, at
    assert streamed(ToolCallStream(parser), list(text)) == want


@pytest.mark.parametrize("parser, text", SPLIT_TEXTS)
def test_random_splits_give_the_non_streamed_result(parser, text):
    rng = random.Random(19)
    want = expected(parser, text)
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(1, min(8, len(text) + 1))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert streamed(ToolCallStream(parser), pieces) == want, pieces


def test_hermes_holds_back_only_a_possible_tag():
    stream = ToolCallStream("hermes")
    assert stream.push("Hi <tool_c") == ["Hi "]
    assert stream.push("all>\n" + call("f", a=1)[:-3]) == []
    assert stream.push("1}}\n</tool_call") == []
    header, arguments = stream.push(">")
    assert (header.index, header.name, header.arguments) == (0, "f", "")
    assert arguments == ToolCallDelta(0, None, None, '{"a":1}')
    assert stream.push(" a <t") == [" a "]
    assert stream.push("!") == ["<t!"]
    assert stream.finish() == []


def test_leading_whitespace_waits_for_content():
    stream = ToolCallStream("hermes")
    assert stream.push("\n\n") == []
    assert stream.push("Hi") == ["\n\nHi"]
    assert stream.push("\n") == ["\n"]


def test_llama3_json_holds_a_json_start_until_finish():
    held = ToolCallStream("llama3_json")
    assert held.push(" <|python") == []
    assert held.push('_tag|>{"name": "f", "parameters": {}}') == []
    assert [type(event) for event in held.finish()] == [ToolCallDelta, ToolCallDelta]
    plain = ToolCallStream("llama3_json")
    assert plain.push(" <") == []
    assert plain.push("b>") == [" <b>"]
    assert plain.push("{}") == ["{}"]
    assert plain.finish() == []


def test_openai_shapes():
    first, later = ToolCallDelta(1, "call_x", "f", ""), ToolCallDelta(1, None, None, '{"a":1}')
    assert first.to_openai() == {"index": 1, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": ""}}
    assert later.to_openai() == {"index": 1, "function": {"arguments": '{"a":1}'}}
    assert ToolCall("call_x", "f", "{}").to_openai() == {
        "id": "call_x", "type": "function", "function": {"name": "f", "arguments": "{}"}
    }
    assert re.fullmatch(r"call_[0-9a-f]{24}", new_call_id()) and new_call_id() != new_call_id()


# ---- grammars: required and named ----------------------------------------------------------------

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time"}},
]


def valid(schema: dict, instance) -> bool:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_named_schema():
    assert named_schema(WEATHER_PARAMS) == WEATHER_PARAMS
    assert named_schema(WEATHER_PARAMS) is not WEATHER_PARAMS
    assert named_schema(None) == named_schema({}) == {"type": "object"}
    assert valid(named_schema(None), {}) and not valid(named_schema(None), [])
    assert valid(named_schema(WEATHER_PARAMS), {"city": "Oslo", "unit": "F"})
    assert not valid(named_schema(WEATHER_PARAMS), {"unit": "F"})


@pytest.mark.parametrize(
    "instance, single, parallel",
    [
        ([{"name": "get_weather", "parameters": {"city": "Oslo"}}], True, True),
        ([{"name": "get_time", "parameters": {}}], True, True),
        ([{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}], False, True),
        ([], False, False),
        ({"name": "get_time", "parameters": {}}, False, False),
        ([{"name": "get_date", "parameters": {}}], False, False),
        ([{"name": "get_time"}], False, False),
        ([{"name": "get_time", "parameters": {}, "extra": 1}], False, False),
        ([{"name": "get_weather", "parameters": {"city": 3}}], False, False),
        ([{"name": "get_weather", "parameters": {"city": "Oslo", "country": "NO"}}], False, False),
    ],
)
def test_required_schema(instance, single, parallel):
    assert valid(required_schema(TOOLS, parallel=False), instance) == single
    assert valid(required_schema(TOOLS, parallel=True), instance) == parallel


def test_required_schema_moves_defs_to_the_root():
    parameters = {
        "type": "object",
        "properties": {"where": {"$ref": "#/$defs/Place"}, "when": {"$ref": "#/definitions/Time"}},
        "required": ["where"],
        "$defs": {"Place": {"type": "object", "properties": {"near": {"$ref": "#/$defs/Place"}}, "required": ["city"]}},
        "definitions": {"Time": {"type": "string"}},
    }
    tools = [{"type": "function", "function": {"name": "go", "parameters": parameters}}]
    schema = required_schema(tools, parallel=True)
    assert set(schema["$defs"]) == {"go.Place", "go.Time"}
    assert valid(schema, [{"name": "go", "parameters": {"where": {"city": "A", "near": {"city": "B"}}, "when": "now"}}])
    assert not valid(schema, [{"name": "go", "parameters": {"where": {"city": "A", "near": {}}}}])
    assert not valid(schema, [{"name": "go", "parameters": {"where": {"city": "A"}, "when": 5}}])
    assert "$defs" in parameters and parameters["properties"]["where"] == {"$ref": "#/$defs/Place"}  # not mutated


def test_required_schema_needs_a_tool():
    with pytest.raises(ValueError, match="at least one function in 'tools'"):
        required_schema([], parallel=True)


REQUIRED_OUTPUT = (
    '[ {"name": "get_weather", "parameters": {"city": "Z\\"ürich}", "nested": {"a": [{"b": "]"}]}}},\n'
    '{"name":"get_time","parameters":{"tz":"\\\\"}}]'
)
REQUIRED_CALLS = [("get_weather", '{"city":"Z\\"ürich}","nested":{"a":[{"b":"]"}]}}'), ("get_time", '{"tz":"\\\\"}')]


def test_calls_from_required():
    calls = calls_from_required(REQUIRED_OUTPUT)
    assert [(c.name, c.arguments) for c in calls] == REQUIRED_CALLS
    assert len({c.id for c in calls}) == 2
    assert [c.name for c in calls_from_required(REQUIRED_OUTPUT[:-12])] == ["get_weather"]  # cut by length


def test_required_stream_emits_each_call_when_its_object_closes():
    stream = RequiredCallStream()
    first_end = REQUIRED_OUTPUT.index("}}},") + 3
    assert stream.push(REQUIRED_OUTPUT[: first_end - 1]) == []
    assert assemble(stream.push(REQUIRED_OUTPUT[first_end - 1 : first_end]))[1] == REQUIRED_CALLS[:1]
    for at in range(len(REQUIRED_OUTPUT) + 1):
        pieces = [REQUIRED_OUTPUT[:at], REQUIRED_OUTPUT[at:]]
        assert streamed(RequiredCallStream(), pieces) == ("", REQUIRED_CALLS), at
    assert streamed(RequiredCallStream(), list(REQUIRED_OUTPUT)) == ("", REQUIRED_CALLS)


def test_required_stream_refuses_unconstrained_output():
    with pytest.raises(ValueError, match="not a call object"):
        RequiredCallStream().push('[{"tool": "f"}]')


def test_named_stream_and_call():
    stream = NamedCallStream("get_weather")
    header, *rest = stream.push('{"city": ')
    assert (header.index, header.name, header.arguments) == (0, "get_weather", "") and header.id.startswith("call_")
    assert rest == [ToolCallDelta(0, None, None, '{"city": ')]
    assert stream.push("") == []
    assert stream.push('"Oslo"}') == [ToolCallDelta(0, None, None, '"Oslo"}')]
    assert stream.finish() == []
    assert streamed(NamedCallStream("now"), []) == ("", [("now", "")])
    assert streamed(NamedCallStream("now"), ["\n", "\n {", '"a": 1}']) == ("", [("now", '{"a": 1}')])  # after thinking
    named = call_from_named("get_weather", '{"city": "Oslo"}')
    assert (named.name, named.arguments) == ("get_weather", '{"city": "Oslo"}') and named.id.startswith("call_")


# ---- default parser ------------------------------------------------------------------------------

QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to "
    "assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags\" }}"
    "{{- \"For each function call, return a json object with function name and arguments within <tool_call></tool_call>"
    " XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call>"
    "<|im_end|>\\n\" }}{%- endif %}"
)
LLAMA31_TEMPLATE = (
    "{%- if builtin_tools is defined or tools is not none %}{{- \"Environment: ipython\\n\" }}{%- endif %}"
    "{{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt.\\n\\n' }}"
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.' }}"
    "{%- if builtin_tool_calls %}{{- '<|python_tag|>' + tool_call.name + '.call(' }}{%- endif %}"
)
LLAMA32_TEMPLATE = (
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}"
    "{{- \"Respond in the format {\\\"name\\\": function name, \\\"parameters\\\": dictionary of argument name and "
    "its value}.\" }}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    "template, parser",
    [
        (QWEN_TEMPLATE, "hermes"),
        (LLAMA31_TEMPLATE, "llama3_json"),
        (LLAMA32_TEMPLATE, "llama3_json"),
        (CHATML_TEMPLATE, "hermes"),
        (None, "hermes"),
        (HARMONY_TEMPLATE, "harmony"),  # gpt-oss's format (tests/support/harmony_models.py)
    ],
)
def test_default_parser(template, parser):
    assert default_parser(template) == parser


def test_a_chunk_carries_each_call_once():
    from serve_app.text.responses import ChatFormatter, ChoiceUpdate

    class NoStrings:
        pass

    update = ChoiceUpdate(0, tool_calls=[ToolCallDelta(0, "call_1", "f", ""), ToolCallDelta(0, None, None, '{"a"'),
                                         ToolCallDelta(0, None, None, ": 1}"), ToolCallDelta(1, "call_2", "g", ""),
                                         ToolCallDelta(1, None, None, "{}")])
    chunk = ChatFormatter("id", "m", NoStrings(), logprobs=False).chunk(update)
    assert chunk.choices[0].delta.tool_calls == [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"index": 1, "id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]
    assert chunk.choices[0].delta.content is None
