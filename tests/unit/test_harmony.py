"""serve_app.text.harmony: gpt-oss's messages read into reasoning, content and tool calls, whole and
streamed (every split of the text, and token by token through a choice's reader with a tokenizer
that has harmony's special tokens); the harmony chat template rendering tools, calls, their results
and the thinking an assistant message carries back; the parsers' selection; and chat completions
through the HTTP layer on a fixed-output engine.

The chat template (tests/support/harmony_template.jinja) is the project's own rendering of the
harmony format, written from OpenAI's description of it (openai/harmony, docs/format.md), whose
example prompts the tests below check it against; gpt-oss's own template cannot be vendored here, so
this is not the checkpoint's template."""

from __future__ import annotations

import datetime
import functools
import random
import re

import pytest
from pydantic import ValidationError

from engine.generate.request import FinishReason, TokenDelta
from serve_app.config import ModelConfig
from serve_app.errors import BadRequest
from serve_app.protocol.chat import ChatMessage, Tool
from serve_app.text import reasoning, tool_calls
from serve_app.text.choices import ChoiceReader, OutputRules
from serve_app.text.detokenize import special_ids
from serve_app.text.harmony import TAGS, HarmonyStream, parse_header, split_harmony
from serve_app.text.reasoning import Thought
from serve_app.text.tokenizer import PromptInput, PromptTokenizer
from tests.support.harmony_models import HARMONY_TEMPLATE, harmony_checkpoint, make_harmony_tokenizer
from tests.support.serving_helpers import app_in_process, sse_events

THOUGHT, ANSWER = 'User asks: "What is 2 + 2?" Simple arithmetic.', "2 + 2 = 4."
FINAL = (f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
         f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>")
CALL_AFTER_CHANNEL = ("<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
                      "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                      '{"location": "San Francisco"}<|call|>')
CALL_IN_ROLE = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
                "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
                '{"city": "Oslo"}<|call|>')
PREAMBLE = ("<|channel|>analysis<|message|>Two files to write.<|end|>"
            "<|start|>assistant<|channel|>commentary<|message|>**Action plan**:\n1. Write index.html<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.generate_file<|constrain|>json<|message|>"
            '{"template": "basic_html", "path": "index.html"}<|call|>')
SEVERAL = ("<|channel|>analysis<|message|>Both cities, and the time.<|end|>"
           "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
           '{"city": "Paris"}<|call|>'
           "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
           '{"zone": "Europe/Oslo"}<|end|>'
           "<|start|>assistant<|channel|>commentary to=functions.get_weather json<|message|>"
           '{"city": "Oslo", "days": [1, 2]}<|call|>')
TIME_CALL = ("get_time", '{"zone":"Europe/Oslo"}')

CASES = [
    # (output, reasoning, content, calls as (name, arguments))
    (FINAL, THOUGHT, ANSWER, []),
    (CALL_AFTER_CHANNEL, "Need to use function get_weather.", "", [("get_weather", '{"location":"San Francisco"}')]),
    (CALL_IN_ROLE, "Need the weather.", "", [("get_weather", '{"city":"Oslo"}')]),
    (  # the first message's header continues the prompt's `<|start|>assistant`
        ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Oslo"}<|call|>',
        "", "", [("get_weather", '{"city":"Oslo"}')]),
    (PREAMBLE, "Two files to write.", "**Action plan**:\n1. Write index.html",
     [("generate_file", '{"template":"basic_html","path":"index.html"}')]),
    (SEVERAL, "Both cities, and the time.", "",
     [("get_weather", '{"city":"Paris"}'), TIME_CALL, ("get_weather", '{"city":"Oslo","days":[1,2]}')]),
    ('<|channel|>analysis to=functions.get_time <|constrain|>json<|message|>{"zone": "Europe/Oslo"}<|call|>',
     "", "", [TIME_CALL]),  # a call on the analysis channel is a call
    ("<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis<|message|>Second.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Done.<|return|>", "First.\nSecond.", "Done.", []),
    ("<|channel|>analysis<|message|>Zürich — 東京 🚀<|end|>"
     "<|start|>assistant<|channel|>final<|message|>ελληνικά<|return|>", "Zürich — 東京 🚀", "ελληνικά", []),
    ("<|channel|>analysis to=python<|message|>print(1)<|call|>", "print(1)", "", []),  # not a function: by channel
    ("<|channel|>analysis<|message|>A<|start|>assistant<|channel|>final<|message|>B<|return|>", "A", "B", []),
    ("<|channel|>final<|message|>a <|b|> and <|en are text<|return|>", "", "a <|b|> and <|en are text", []),
    ("<|channel|>final<|message|>\n \n<|return|>", "", "", []),  # whitespace only: no content
    ("<|channel|>final<|message|>Paris is the cap", "", "Paris is the cap", []),  # a length cut mid-answer
    ('<|channel|>commentary to=functions.get_time<|message|>{"zone": "Europe/Oslo"}', "", "", [TIME_CALL]),
    # ---- malformed output degrades to content (or, a header cut short, to nothing)
    ("Plain text from a model that ignores the format: a < b.", "",
     "Plain text from a model that ignores the format: a < b.", []),
    ("<|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>fin", "Let me think.", "", []),
    ("<|channel|>final", "", "", []),  # the header never closes
    ("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant", "Hmm.", "", []),
    ("<|channel|>notes<|message|>Unknown channel.<|end|><|start|>assistant<|channel|>final<|message|>Answer.<|return|>",
     "", "Unknown channel.\nAnswer.", []),
    ("<|message|>No header at all.<|return|>", "", "No header at all.", []),
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": Paris}<|call|>',
     "", '{"city": Paris}', []),  # not JSON
    ('<|channel|>commentary to=functions.get_weather<|message|>["Paris"]<|call|>', "", '["Paris"]', []),  # no object
    ('<|channel|>commentary to=functions.get_weather<|message|>{"city": "Pa', "", '{"city": "Pa', []),  # cut off
    ('<|channel|>commentary to=functions.<|message|>{}<|call|>', "", "{}", []),  # no function name
    ("<|channel|>analysis<|message|>Hmm.<|end|>stray text<|start|>assistant<|channel|>final<|message|>Yes.<|return|>",
     "Hmm.", "stray text\nYes.", []),
]


def collect(events) -> tuple[str, str, list[tuple[str, str]]]:
    """(reasoning, content, calls) of a stream's events, checking their shape: no empty events; call
    indices 0, 1, ... with id, name and "" first, then their arguments once."""
    thought, content, calls = "", "", []
    for event in events:
        if isinstance(event, Thought):
            assert event.text
            thought += event.text
        elif isinstance(event, str):
            assert event
            content += event
        elif event.id is not None:
            assert (event.index, event.arguments) == (len(calls), "") and re.fullmatch(r"call_[0-9a-f]{24}", event.id)
            calls.append([event.name, None])
        else:
            assert event.index == len(calls) - 1 and calls[-1][1] is None and event.name is None
            calls[-1][1] = event.arguments
    return thought, content, [tuple(call) for call in calls]


def streamed(text: str, cuts, **options) -> tuple[str, str, list[tuple[str, str]]]:
    stream, events, start = HarmonyStream(**options), [], 0
    for cut in [*cuts, len(text)]:
        events += stream.push(text[start:cut])
        start = cut
    return collect(events + stream.finish())


@pytest.mark.parametrize("text,thought,content,calls", CASES)
def test_whole_outputs(text, thought, content, calls):
    assert collect(split_harmony(text)) == (thought, content, calls)


@pytest.mark.parametrize("text,thought,content,calls", CASES)
def test_every_split_gives_the_whole_result(text, thought, content, calls):
    for cut in range(len(text) + 1):
        assert streamed(text, [cut]) == (thought, content, calls), cut
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(6, len(text))))
        assert streamed(text, cuts) == (thought, content, calls), cuts
    assert streamed(text, range(1, len(text))) == (thought, content, calls)  # a character at a time


def test_text_streams_as_it_comes_holding_back_only_a_possible_tag():
    stream = HarmonyStream()
    assert stream.push("<|channel|>analy") == []  # a header goes nowhere until it closes
    assert stream.push("sis<|message|>Let me <|") == [Thought("Let me ")]
    assert stream.push("think.<|en") == [Thought("<|think.")]
    assert stream.push("d|><|start|>assistant<|channel|>final<|message|>Yes") == ["Yes"]
    assert stream.push('<|end|><|start|>assistant to=functions.f<|channel|>commentary<|message|>{"a": 1}') == []
    assert collect(stream.finish())[2] == [("f", '{"a":1}')]


def test_without_tools_a_call_is_content_and_without_thinking_analysis_is_content():
    assert collect(split_harmony(CALL_AFTER_CHANNEL, calls=False)) == (
        "Need to use function get_weather.", '{"location": "San Francisco"}', [])
    assert collect(split_harmony(FINAL, thinking=False)) == ("", f"{THOUGHT}\n{ANSWER}", [])


@pytest.mark.parametrize("header,channel,recipient", [
    ("<|channel|>final", "final", None),
    ("<|channel|>commentary to=functions.get_weather <|constrain|>json", "commentary", "functions.get_weather"),
    ("<|channel|>commentary to=functions.get_weather<|constrain|>json", "commentary", "functions.get_weather"),
    ("assistant to=functions.get_weather<|channel|>commentary json", "commentary", "functions.get_weather"),
    (" to=functions.x<|channel|>analysis", "analysis", "functions.x"),
    ("functions.get_weather to=assistant<|channel|>commentary", "commentary", "assistant"),
    ("assistant", None, None),
])
def test_headers(header, channel, recipient):
    parsed = parse_header(header)
    assert (parsed.channel, parsed.recipient) == (channel, recipient)


# ---- token by token through a choice's reader, with harmony's special tokens ----------------------


@pytest.fixture(scope="module")
def tokenizer():
    return make_harmony_tokenizer()


def read_tokens(tokenizer, ids: list[int], reader_options=None) -> tuple[str, str, list[tuple[str, str]], str]:
    """(reasoning, content, calls, finish reason) of `ids` fed to a chat choice's reader one token a
    step, its text keeping harmony's special tokens (the replica's rules for a harmony chat)."""
    keep = frozenset(tokenizer.convert_tokens_to_ids(list(TAGS))) & special_ids(tokenizer)
    rules = OutputRules(stops=[], echo=False, drop_output=False, logprobs=False, keep_special=keep,
                        calls=functools.partial(HarmonyStream, **(reader_options or {})))
    prompt = tokenizer.encode("<|start|>user<|message|>Hi<|end|><|start|>assistant", add_special_tokens=False)
    reader = ChoiceReader(tokenizer, 0, PromptInput(prompt), rules)
    text = reasoning_text = ""
    deltas = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        update = reader.read(TokenDelta("r", [token], finish_reason=FinishReason.STOP if last else None,
                                        num_prompt_tokens=len(prompt) if i == 0 else 0))
        if update is not None:
            text, reasoning_text = text + update.text, reasoning_text + update.reasoning
            deltas += update.tool_calls
    events = ([Thought(reasoning_text)] if reasoning_text else []) + ([text] if text else []) + deltas
    return (*collect(events), reader.reason)


@pytest.mark.parametrize("text,thought,content,calls", CASES)
def test_token_by_token_through_the_choice_reader(tokenizer, text, thought, content, calls):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert read_tokens(tokenizer, ids) == (thought, content, calls, "tool_calls" if calls else "stop")


def test_special_tokens_are_single_special_ids(tokenizer):
    ids = tokenizer.encode(FINAL, add_special_tokens=False)
    specials = [t for t in ids if t in special_ids(tokenizer)]
    assert tokenizer.convert_ids_to_tokens(specials) == ["<|channel|>", "<|message|>", "<|end|>", "<|start|>",
                                                         "<|channel|>", "<|message|>", "<|return|>"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == f"analysis{THOUGHT}assistantfinal{ANSWER}"


# ---- selection ----------------------------------------------------------------------------------


def test_a_harmony_template_selects_harmony_for_both_roles():
    assert reasoning.default_parser(HARMONY_TEMPLATE) == "harmony"
    assert tool_calls.default_parser(HARMONY_TEMPLATE) == "harmony"


@pytest.mark.parametrize("tool_parser,reasoning_parser,ok", [
    ("harmony", "harmony", True), ("harmony", None, True), (None, "harmony", True), ("harmony", "none", True),
    ("harmony", "qwen3", False), ("hermes", "harmony", False), ("llama3_json", "harmony", False),
])
def test_harmony_is_one_format_for_both_parsers(tool_parser, reasoning_parser, ok):
    args = {"model": "/ckpt/gpt-oss", "tool_call_parser": tool_parser, "reasoning_parser": reasoning_parser}
    if ok:
        config = ModelConfig(**args)
        assert (config.tool_call_parser, config.reasoning_parser) == (tool_parser, reasoning_parser)
    else:
        with pytest.raises(ValidationError, match="harmony is one format for a model's thinking and its tool calls"):
            ModelConfig(**args)


# ---- the prompt: the project's harmony chat template, laid out as the format describes -------------


@pytest.fixture(scope="module")
def prompts(llama_dir, tmp_path_factory) -> PromptTokenizer:
    return PromptTokenizer(str(harmony_checkpoint(llama_dir, tmp_path_factory.mktemp("gpt-oss"))), "gpt-oss")


def render(prompts: PromptTokenizer, messages: list[dict], tools=(), **template_kwargs) -> str:
    """The prompt of `messages` (request JSON, through the protocol's models) with the day it was
    rendered written as DATE; its token ids decode back to it."""
    before = datetime.date.today().isoformat()
    prompt = prompts.chat([ChatMessage(**m) for m in messages], [Tool(**t) for t in tools],
                          template_kwargs=template_kwargs)
    assert prompts.hf.decode(prompt.ids, skip_special_tokens=False) == prompt.rendered
    for day in {before, datetime.date.today().isoformat()}:
        if f"Current date: {day}\n" in prompt.rendered:
            return prompt.rendered.replace(f"Current date: {day}\n", "Current date: DATE\n")
    raise AssertionError(f"no current date in {prompt.rendered!r}")


def system(effort: str = "medium", tools: bool = False) -> str:
    return ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
            f"Knowledge cutoff: 2024-06\nCurrent date: DATE\n\nReasoning: {effort}\n\n"
            "# Valid channels: analysis, commentary, final. Channel must be included for every message."
            + ("\nCalls to these tools must go to the commentary channel: 'functions'." if tools else "") + "<|end|>")


CLASS = {"type": "string", "enum": ["first", "second"], "default": "second"}
TRAIN_TOOLS = [  # our own example, in every shape the format's TypeScript-like declarations take
    {"type": "function", "function": {"name": "nearest_station", "description": "Finds the station nearest the user."}},
    {"type": "function", "function": {
        "name": "departures", "description": "Lists the next trains leaving a station.",
        "parameters": {"type": "object", "required": ["station"], "properties": {
            "station": {"type": "string", "description": "The station's name, e.g. Oslo S"},
            "class": CLASS}}}},
    {"type": "function", "function": {
        "name": "fares", "description": "Looks up fares between several stations.",
        "parameters": {"type": "object", "required": ["stations"], "properties": {
            "stations": {"type": "array", "items": {"type": "string"}, "description": "Stations in travel order"},
            "class": CLASS}}}},
]
TRAIN_PROMPT = (  # the system, developer and user messages as the harmony format lays them out (date as DATE)
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: DATE\n\nReasoning: high\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
    "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
    "<|start|>developer<|message|># Instructions\n\nAnswer in one sentence.\n\n# Tools\n\n## functions\n\n"
    "namespace functions {\n\n"
    "// Finds the station nearest the user.\ntype nearest_station = () => any;\n\n"
    "// Lists the next trains leaving a station.\ntype departures = (_: {\n"
    "// The station's name, e.g. Oslo S\nstation: string,\n"
    'class?: "first" | "second", // default: second\n}) => any;\n\n'
    "// Looks up fares between several stations.\ntype fares = (_: {\n"
    "// Stations in travel order\nstations: string[],\n"
    'class?: "first" | "second", // default: second\n}) => any;\n\n'
    "} // namespace functions<|end|>"
    "<|start|>user<|message|>When is the next train to Bergen?<|end|><|start|>assistant"
)
TRAIN = [{"role": "system", "content": "Answer in one sentence."},
         {"role": "user", "content": "When is the next train to Bergen?"}]


def test_a_prompt_with_instructions_and_functions_is_laid_out_as_the_format_says(prompts):
    assert render(prompts, TRAIN, TRAIN_TOOLS, reasoning_effort="high") == TRAIN_PROMPT
    ask = "<|start|>user<|message|>When is the next train to Bergen?<|end|><|start|>assistant"
    assert render(prompts, TRAIN[1:]) == system() + ask  # no instructions and no tools: no developer message
    instructions = "<|start|>developer<|message|># Instructions\n\nAnswer in one sentence.<|end|>"
    assert render(prompts, TRAIN) == system() + instructions + ask


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [
    {"role": "developer", "content": "Be brief."},
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [CALL],
     "reasoning_content": "Need to use function get_weather."},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sunny": true, "temperature": 20}'},
]
CALL_TURN = (  # HISTORY after the instructions, as the format description's tool-call example writes it (a
    # call's recipient in the role part of its header, which the format allows)
    "<|start|>user<|message|>What is the weather in Paris?<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
    '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
    '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"sunny": true, "temperature": 20}'
    "<|end|>"
)


def test_a_call_its_thinking_and_its_result_round_trip(prompts):
    assert render(prompts, HISTORY, [WEATHER], reasoning_effort="high") == (
        system("high", tools=True) + "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n"
        '## functions\n\nnamespace functions {\n\n// Weather now\ntype get_weather = (_: {\ncity: "Paris" | "Oslo",\n'
        "}) => any;\n\n} // namespace functions<|end|>" + CALL_TURN + "<|start|>assistant")
    ids = prompts.chat([ChatMessage(**m) for m in HISTORY], [Tool(**WEATHER)]).ids
    assert ids.count(prompts.hf.convert_tokens_to_ids("<|start|>")) == 7  # one special id per message
    preamble = {**HISTORY[2], "content": "Checking.", "reasoning": HISTORY[2]["reasoning_content"]}  # both names
    assert render(prompts, [*HISTORY[1:2], preamble, HISTORY[3]], [WEATHER]).endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"sunny": true, "temperature": 20}'
        "<|end|><|start|>assistant")


def test_a_finished_turns_thinking_is_dropped(prompts):
    """The next sampling after a final answer, as the format says: the answer's analysis is left out
    (its `<|return|>` stored as `<|end|>`), and so is that of the calls in a finished turn."""
    two_turns = [
        {"role": "user", "content": "Name a prime above 10."},
        {"role": "assistant", "content": "11.", "reasoning": "The smallest prime above 10 is 11."},
        {"role": "user", "content": "And above 20?"},
    ]
    assert render(prompts, two_turns) == system() + (
        "<|start|>user<|message|>Name a prime above 10.<|end|><|start|>assistant<|channel|>final<|message|>11.<|end|>"
        "<|start|>user<|message|>And above 20?<|end|><|start|>assistant")
    answered = [*HISTORY[1:], {"role": "assistant", "content": "20 degrees, sunny.", "reasoning_content": "Report."},
                {"role": "user", "content": "And tomorrow?"}]
    assert render(prompts, answered, [WEATHER]).endswith(
        "<|start|>user<|message|>What is the weather in Paris?<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"sunny": true, "temperature": 20}'
        "<|end|><|start|>assistant<|channel|>final<|message|>20 degrees, sunny.<|end|>"
        "<|start|>user<|message|>And tomorrow?<|end|><|start|>assistant")


def test_a_result_that_answers_no_call_is_a_400(prompts):
    with pytest.raises(BadRequest, match="tool message call_9 answers no call of the assistant before it"):
        render(prompts, [*HISTORY[:3], {**HISTORY[3], "tool_call_id": "call_9"}], [WEATHER])


# ---- chat completions through the HTTP layer, on an engine that says a fixed harmony output --------

MODEL = "gpt-oss"
CALL_OUTPUT = ("<|channel|>analysis<|message|>The user wants the weather; call get_weather.<|end|>"
               "<|start|>assistant<|channel|>commentary<|message|>Checking the weather.<|end|>"
               "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
               '{"city": "Paris"}<|call|>')


@pytest.fixture(scope="module")
def served(checkpoint_factory, tmp_path_factory):
    """(http client, token count of the output) of an app whose model says `output`, per output."""
    long_llama = checkpoint_factory("llama", max_position_embeddings=1024)  # room for gpt-oss's system prompt
    with_apps = {}

    def serve(output: str):
        if output not in with_apps:
            out = harmony_checkpoint(long_llama, tmp_path_factory.mktemp("gpt-oss"), output)
            app = app_in_process(out, MODEL, engine_cls="tests.support.fake_engine:FixedOutputEngine",
                                 max_model_len=1024, max_num_seqs=4)
            server, http, _ = app.__enter__()
            with_apps[output] = (app, http, len(server.tokenizer.encode(output, add_special_tokens=False)))
        return with_apps[output][1:]

    yield serve
    for app, _, _ in with_apps.values():
        app.__exit__(None, None, None)


def post_chat(http, **body) -> dict:
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 300, **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream_chat(http, **body) -> tuple[str, str, list[dict], list, list[str]]:
    """(reasoning, content, joined calls, finish reasons, order of the deltas' kinds) of a streamed chat."""
    with http.stream("POST", "/v1/chat/completions",
                     json={"model": MODEL, "messages": ASK, "max_tokens": 300, "stream": True, **body}) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    thought = content = ""
    calls, reasons, order = {}, [], []
    for chunk in events[:-1]:
        choice = chunk["choices"][0]
        delta = choice["delta"]
        thought += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        order += ["thought"] * bool(delta.get("reasoning_content")) + ["content"] * bool(delta.get("content"))
        for call in delta.get("tool_calls") or []:
            joined = calls.setdefault(call["index"], {"name": None, "arguments": ""})
            joined["name"] = call["function"].get("name", joined["name"])
            joined["arguments"] += call["function"]["arguments"]
        reasons.append(choice["finish_reason"])
    return thought, content, [calls[i] for i in sorted(calls)], reasons, order


def test_analysis_and_final_become_reasoning_and_content(served):
    http, completion_tokens = served(FINAL)
    body = post_chat(http)
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": ANSWER,
                                                        "reasoning_content": THOUGHT},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"]["completion_tokens"] == completion_tokens
    thought, content, calls, reasons, order = stream_chat(http)
    assert (thought, content, calls, reasons[-1]) == (THOUGHT, ANSWER, [], "stop")
    assert set(reasons[:-1]) == {None} and order == sorted(order, key=lambda kind: kind == "content")
    assert len(order) > 2  # streamed in pieces, not at the end


def test_a_preamble_and_a_call_become_content_and_tool_calls(served):
    http, _ = served(CALL_OUTPUT)
    body = post_chat(http, tools=[WEATHER])
    [choice] = body["choices"]
    [call] = choice["message"].pop("tool_calls")
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.pop("id"))
    assert call == {"type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    assert choice == {"index": 0, "message": {
        "role": "assistant", "content": "Checking the weather.",
        "reasoning_content": "The user wants the weather; call get_weather."}, "logprobs": None,
        "finish_reason": "tool_calls"}
    thought, content, calls, reasons, _ = stream_chat(http, tools=[WEATHER])
    assert (thought, content, reasons[-1]) == ("The user wants the weather; call get_weather.", "Checking the weather.",
                                               "tool_calls")
    assert calls == [{"name": "get_weather", "arguments": '{"city":"Paris"}'}]


def test_without_tools_the_call_is_content_and_no_tag_leaks(served):
    http, _ = served(CALL_OUTPUT)
    body = post_chat(http)
    assert body["choices"][0]["message"] == {"role": "assistant",
                                             "content": 'Checking the weather.\n{"city": "Paris"}',
                                             "reasoning_content": "The user wants the weather; call get_weather."}
    assert body["choices"][0]["finish_reason"] == "stop"
    thought, content, calls, reasons, _ = stream_chat(http)
    assert (content, calls, reasons[-1]) == ('Checking the weather.\n{"city": "Paris"}', [], "stop")
    assert not any(tag in thought + content for tag in TAGS)
