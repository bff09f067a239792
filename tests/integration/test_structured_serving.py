"""Structured outputs and tool calls through the OpenAI API: the official `openai` client against
the app in this process, on the real engine and a tiny RANDOM checkpoint (its free text is
garbage, so only the constraint can make an answer valid), or on a fixed-output engine where the
test needs the model to say something exact (`tool_choice: auto`).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.support.fake_engine import FIXED_OUTPUT_FILE
from tests.support.serving_helpers import app_in_process, templated_checkpoint

MODEL = "tiny"
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n"
    "{%- for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for call in message.tool_calls %}<tool_call>\n"
    "{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def long_llama(checkpoint_factory):
    """A tiny Llama with room for the tools' JSON (~500 tokens with the tiny tokenizer)."""
    return checkpoint_factory("llama", max_position_embeddings=1024)


def tools_checkpoint(model_dir, tmp_path_factory, fixed_output: list[int] | None = None):
    """The tiny checkpoint with a chat template that renders tools (and `fixed_output.json`)."""
    return templated_checkpoint(model_dir, tmp_path_factory.mktemp("tools-ckpt"), TOOLS_TEMPLATE, fixed_output)


def serve(checkpoint, **args):
    return app_in_process(checkpoint, MODEL, **{"max_model_len": 1024, "max_num_seqs": 8, **args})


@pytest.fixture(scope="module")
def served(long_llama, tmp_path_factory):
    with serve(tools_checkpoint(long_llama, tmp_path_factory)) as served:
        yield served


@pytest.fixture(scope="module")
def client(served):
    return served[2]


@pytest.fixture(scope="module")
def http(served):
    return served[1]


def person_format(name="person"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": PERSON, "strict": True}}


def test_json_schema_chat_n3_validates_for_several_seeds(client):
    for seed in (1, 2, 3):
        response = client.chat.completions.create(model=MODEL, messages=ASK, n=3, seed=seed, temperature=1.0,
                                                  max_tokens=60, response_format=person_format())
        assert len(response.choices) == 3
        for choice in response.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), PERSON)
        assert len({c.message.content for c in response.choices}) > 1  # three samples, not one


def test_json_schema_streamed_with_logprobs(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, n=3, seed=7, temperature=1.0, max_tokens=60,
                                            response_format=person_format(), stream=True, logprobs=True,
                                            top_logprobs=2, stream_options={"include_usage": True})
    texts, finish, logprobs = {}, {}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            logprobs.setdefault(choice.index, []).extend(choice.logprobs.content if choice.logprobs else [])
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
        usage = chunk.usage or None
    assert finish == {0: "stop", 1: "stop", 2: "stop"}
    for i, text in texts.items():
        jsonschema.validate(json.loads(text), PERSON)
        assert bytes(b for lp in logprobs[i] for b in lp.bytes).decode() == text
        assert all(len(lp.top_logprobs) == 2 for lp in logprobs[i])
    assert usage.completion_tokens == sum(len(lps) for lps in logprobs.values())


def test_json_object_on_completions(client, served):
    tokenizer = served[0].tokenizer
    closers = {str(t): 6 for t in range(len(tokenizer)) if tokenizer.decode([t]).strip() in ("}", "\"}")}
    response = client.completions.create(model=MODEL, prompt="Hello", n=3, seed=4, temperature=1.0, max_tokens=100,
                                         logit_bias=closers, extra_body={"response_format": {"type": "json_object"}})
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.text
        assert isinstance(json.loads(choice.text), dict)


def test_max_tokens_cuts_with_length(client):
    response = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, response_format=person_format())
    choice = response.choices[0]
    assert (choice.finish_reason, response.usage.completion_tokens) == ("length", 3)
    assert choice.message.content.startswith("{")


@pytest.mark.parametrize("response_format,message,param", [
    (person_format() | {"json_schema": {"name": "x", "schema": {"type": "objekt"}}},
     "invalid JSON schema: Invalid type: objekt", "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}},
     "response_format.json_schema.name: String should match pattern '^[A-Za-z0-9_-]{1,64}$'",
     "response_format.json_schema.name"),
])
def test_invalid_response_format_is_a_400(http, response_format, message, param):
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK,
                                                       "response_format": response_format})
    assert (response.status_code, response.json()) == (400, {"error": {
        "message": message, "type": "invalid_request_error", "param": param, "code": None}})


@pytest.mark.parametrize("structured,check", [
    ({"choice": ["yes", "no", 'it "depends"']}, lambda text: text in ("yes", "no", 'it "depends"')),
    ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda text: __import__("re").fullmatch("[0-9]{3}-[a-z]{2}", text)),
    ({"grammar": 'start: "(" item ("," item)* ")"\nitem: "a" | "b"'},
     lambda text: __import__("re").fullmatch(r"\([ab](,[ab])*\)", text)),
    ({"json": PERSON}, lambda text: jsonschema.validate(json.loads(text), PERSON) is None),
])
def test_vllm_structured_outputs(client, structured, check):
    response = client.chat.completions.create(model=MODEL, messages=ASK, n=3, seed=9, temperature=1.0, max_tokens=60,
                                              extra_body={"structured_outputs": structured})
    for choice in response.choices:
        assert choice.finish_reason == "stop" and check(choice.message.content), choice.message.content


def test_structured_outputs_takes_exactly_one_constraint(http):
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                  "structured_outputs": {"regex": "a+", "choice": ["a"]}})
    assert (response.status_code, response.json()["error"]["message"]) == (
        400, "structured_outputs takes exactly one of json, regex, choice, grammar")


def test_named_tool_choice_calls_that_function_with_valid_arguments(client):
    choice_of = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice_of, n=3,
                                              seed=11, temperature=1.0, max_tokens=40)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["get_weather"])


def closing_bias(tokenizer) -> dict[str, int]:
    """A logit bias towards tokens that close an array: the random model would otherwise go on
    adding calls; the grammar still decides what is allowed."""
    return {str(t): 5 for t in range(len(tokenizer)) if tokenizer.decode([t]).strip() in ("]", "}]")}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_makes_valid_calls(client, served, parallel):
    made = 0
    for seed in (21, 22, 23):
        response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                  parallel_tool_calls=parallel, seed=seed, temperature=1.0,
                                                  max_tokens=150, logit_bias=closing_bias(served[0].tokenizer))
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        assert len({c.id for c in calls}) == len(calls)
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
        made += len(calls)
    assert made >= 3


def joined_calls(stream) -> tuple[dict, str]:
    """Tool calls joined from streamed deltas as OpenAI clients join them: by index, name and id
    from the first delta, arguments concatenated; and the finish reason."""
    calls, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.index not in calls and delta.function.name and delta.type == "function"
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                calls[delta.index]["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_call_deltas_join_into_valid_calls(client, served, tool_choice):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                            seed=5, temperature=1.0, max_tokens=150, stream=True,
                                            logit_bias=closing_bias(served[0].tokenizer))
    calls, finish = joined_calls(stream)
    assert finish == "tool_calls" and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])
    if isinstance(tool_choice, dict):
        assert [c["name"] for c in calls.values()] == ["get_time"]


def test_tool_result_round_trips_through_the_template(http, served):
    """An assistant message with tool_calls and the tool's answer reach the template as the
    template expects them (arguments as an object), in /tokenize and in chat alike."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "celsius": true}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    expected = served[0].tokenizer.apply_chat_template(
        [ASK[0], {"role": "assistant", "content": "", "tool_calls": [
            {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris", "celsius": True}}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}],
        tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"arguments": {"city": "Paris", "celsius": true}' in expected and "21 degrees, sunny" in expected
    tokens = http.post("/tokenize", json={"model": MODEL, "messages": messages, "tools": TOOLS}).json()
    assert tokens["tokens"] == served[0].tokenizer.encode(expected, add_special_tokens=False)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 1024
    assert http.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json() == {"prompt": expected}
    answer = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": TOOLS,
                                                     "max_tokens": 5, "seed": 1})
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == tokens["count"]


def test_tool_choice_naming_an_undeclared_function_is_a_400(http):
    response = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "launch_rocket"}}})
    assert (response.status_code, response.json()["error"]["param"]) == (400, "tool_choice")
    assert response.json()["error"]["message"] == ("tool_choice names function 'launch_rocket', which is not among "
                                                   "the declared tools ['get_weather', 'get_time']")


def test_constrained_and_free_requests_share_the_engine(client):
    """A free-text greedy answer is the same with constrained requests running beside it."""
    def free():
        return client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=30, temperature=0)

    alone = free().choices[0].text
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(client.chat.completions.create, model=MODEL, messages=ASK, seed=s, max_tokens=60,
                                   temperature=1.0, response_format=person_format()) for s in range(3)]
        beside = pool.submit(free)
        for future in constrained:
            jsonschema.validate(json.loads(future.result().choices[0].message.content), PERSON)
        assert beside.result().choices[0].text == alone


AUTO_OUTPUT = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "celsius": false}}\n'
               '</tool_call>')


@pytest.fixture(scope="module")
def fixed(long_llama, tmp_path_factory):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(long_llama)
    ids = tokenizer.encode(AUTO_OUTPUT, add_special_tokens=False) + [tokenizer.eos_token_id]
    with serve(tools_checkpoint(long_llama, tmp_path_factory, ids), engine_cls="tests.support.fake_engine:FixedOutputEngine") as (
            _, _, client):
        yield client


def test_auto_parses_the_models_tool_call_block(fixed):
    response = fixed.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=100)
    choice = response.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", "Let me check.")
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo", "celsius": False})


def test_auto_streamed(fixed):
    stream = fixed.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=100, stream=True)
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls, finish = joined_calls(iter(chunks))
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Oslo", "celsius": False})]


def test_without_tools_the_block_is_plain_text(fixed):
    response = fixed.chat.completions.create(model=MODEL, messages=ASK, max_tokens=100)
    assert (response.choices[0].finish_reason, response.choices[0].message.content) == ("stop", AUTO_OUTPUT)
    assert not response.choices[0].message.tool_calls


def test_auto_reads_tags_the_tokenizer_makes_special(long_llama, tmp_path_factory):
    """A tokenizer where `<tool_call>` / `</tool_call>` are special tokens (decoding drops
    specials): under tool_choice auto they still reach the parser; EOS still does not show."""
    from transformers import AutoTokenizer

    out = tools_checkpoint(long_llama, tmp_path_factory)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "vocab_size": len(tokenizer)}))
    start, end = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    call = '\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
    ids = (tokenizer.encode("Checking.", add_special_tokens=False) + [start]
           + tokenizer.encode(call, add_special_tokens=False) + [end, tokenizer.eos_token_id])
    (out / FIXED_OUTPUT_FILE).write_text(json.dumps(ids))
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Checking." + call
    with serve(out, engine_cls="tests.support.fake_engine:FixedOutputEngine") as (_, _, client):
        response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=100)
        plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=100)
    choice = response.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", "Checking.")
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_time", '{"zone":"UTC"}')]
    assert plain.choices[0].message.content == "Checking." + call  # without tools, specials are dropped


def test_vllms_older_guided_fields_constrain_the_real_engine(client):
    """guided_choice / guided_regex (vLLM's older names, still sent by many clients) constrain as
    structured_outputs does: a random model's free text is garbage, so only the constraint makes
    these answers."""
    colors = ["red", "green", "blue"]
    response = client.completions.create(model=MODEL, prompt="Pick a color:", max_tokens=8, n=3, seed=2,
                                         temperature=1.0, extra_body={"guided_choice": colors})
    assert all(c.text in colors and c.finish_reason == "stop" for c in response.choices)
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, seed=3, temperature=1.0,
                                          extra_body={"guided_regex": "[0-9]{3}"})
    assert chat.choices[0].message.content.isdigit() and len(chat.choices[0].message.content) == 3
