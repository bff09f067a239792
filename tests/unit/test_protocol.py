"""serve_app.protocol and serve_app.errors: request parsing (every field), the 400s for unsupported
or invalid fields, conversion to SamplingParams, and OpenAI error bodies."""

from __future__ import annotations

import json
import pickle

import pytest
from ray.exceptions import ActorDiedError, RayTaskError
from ray.serve.exceptions import BackPressureError

from engine.errors import EngineDeadError, InvalidRequestError
from engine.generate.request import Grammar, SamplingParams
from serve_app.errors import (
    APIError,
    BadRequest,
    NotFound,
    Overloaded,
    Unauthorized,
    to_api_error,
)
from serve_app.protocol.base import parse_request
from serve_app.protocol.chat import ChatCompletionRequest
from serve_app.protocol.completions import CompletionRequest


def parse(cls, **body):
    return parse_request(cls, json.dumps(body).encode())


def rejected(cls, **body) -> dict:
    """The error body of a request that must be a 400."""
    with pytest.raises(BadRequest) as info:
        parse(cls, **body)
    assert info.value.status == 400
    return info.value.body()


def error(message: str, param) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}


MESSAGES = [{"role": "user", "content": "Hi"}]


# ---- completions ----


def test_completion_with_every_field():
    request = parse(
        CompletionRequest,
        model="m",
        prompt="Hello",
        best_of=2,
        echo=True,
        frequency_penalty=0.5,
        logit_bias={"7": -100, "9": 2.5},
        logprobs=3,
        max_tokens=7,
        n=2,
        presence_penalty=-0.5,
        seed=11,
        stop=["\n", "END"],
        stream=True,
        stream_options={"include_usage": True},
        temperature=0.7,
        top_p=0.9,
        user="someone",
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        stop_token_ids=[3, 4],
        ignore_eos=True,
        min_tokens=2,
    )
    assert request.prompts == ["Hello"]
    assert request.stops == ["\n", "END"]
    assert request.include_usage
    assert request.to_sampling_params() == SamplingParams(
        max_tokens=7,
        min_tokens=2,
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        presence_penalty=-0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        logit_bias=((7, -100.0), (9, 2.5)),
        seed=11,
        stop_token_ids=(3, 4),
        ignore_eos=True,
        logprobs=3,
        prompt_logprobs=3,
    )


def test_completion_defaults_are_openai_defaults():
    request = parse(CompletionRequest, model="m", prompt="x")
    assert request.to_sampling_params() == SamplingParams(max_tokens=16, temperature=1.0)
    assert (request.n, request.stream, request.echo, request.stops, request.include_usage) == (
        1,
        False,
        False,
        [],
        False,
    )


def test_null_means_default():
    request = parse(CompletionRequest, model="m", prompt="x", max_tokens=None, temperature=None, stop=None, n=None)
    assert (request.max_tokens, request.temperature, request.stops, request.n) == (16, 1.0, [], 1)


@pytest.mark.parametrize(
    "prompt, prompts",
    [
        ("text", ["text"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_every_prompt_form(prompt, prompts):
    assert parse(CompletionRequest, model="m", prompt=prompt).prompts == prompts


@pytest.mark.parametrize("prompt", [[], [[]], [1, "a"], 3, [[1], "a"], [True, False], {"text": "x"}])
def test_malformed_prompts(prompt):
    assert rejected(CompletionRequest, model="m", prompt=prompt) == error(
        "prompt must be a string, a non-empty list of strings, a non-empty list of token ids, "
        "or a non-empty list of non-empty token-id lists",
        "prompt",
    )


def test_echo_with_zero_max_tokens_asks_the_engine_for_one_token():
    params = parse(CompletionRequest, model="m", prompt="x", echo=True, logprobs=0, max_tokens=0).to_sampling_params()
    assert (params.max_tokens, params.logprobs, params.prompt_logprobs) == (1, 0, 0)


def test_top_k_minus_one_disables_it():
    assert parse(CompletionRequest, model="m", prompt="x", top_k=-1).to_sampling_params().top_k == 0


@pytest.mark.parametrize(
    "body, message, param",
    [
        ({"suffix": "tail"}, "'suffix' is not supported yet", "suffix"),
        ({"best_of": 3}, "best_of > n is not supported yet; set best_of to n or leave it out", "best_of"),
        ({"best_of": 1, "n": 2}, "best_of (1) must be at least n (2)", "best_of"),
        ({"foo": 1}, "'foo' is not a supported field; remove it", "foo"),
        (
            {"stream_options": {"include_usage": True}},
            "stream_options is only allowed when stream is true",
            "stream_options",
        ),
        ({"stop": ["a", ""]}, "stop strings must not be empty", "stop"),
        ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids, got 'x'", "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias values must be in [-100, 100], got 101.0 for 5", "logit_bias"),
        ({"n": 0}, "n: Input should be greater than or equal to 1", "n"),
        ({"max_tokens": -1}, "max_tokens: Input should be greater than or equal to 0", "max_tokens"),
        (
            {"temperature": "hot"},
            "temperature: Input should be a valid number, unable to parse string as a number",
            "temperature",
        ),
    ],
)
def test_completion_400s(body, message, param):
    assert rejected(CompletionRequest, model="m", prompt="x", **body) == error(message, param)


def test_missing_model_and_invalid_json():
    assert rejected(CompletionRequest, prompt="x") == error("model: Field required", "model")
    with pytest.raises(BadRequest) as info:
        parse_request(CompletionRequest, b'{"model": ')
    assert info.value.message.startswith("Invalid JSON: EOF while parsing")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("temperature", -1.0, "temperature must be non-negative"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),
        ("presence_penalty", 3.0, "presence_penalty must be in [-2, 2]"),
        ("logprobs", 21, "logprobs must be between 0 and 20"),
        ("min_tokens", 99, "min_tokens must not exceed max_tokens"),
    ],
)
def test_out_of_range_sampling_values_are_400s_naming_the_field(field, value, message):
    request = parse(CompletionRequest, model="m", prompt="x", **{field: value})
    with pytest.raises(InvalidRequestError) as info:
        request.to_sampling_params()
    assert to_api_error(info.value).body() == error(message, field)


# ---- chat ----


def test_chat_with_every_supported_field():
    request = parse(
        ChatCompletionRequest,
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "u"},
            {"role": "assistant", "content": None},
        ],
        model="m",
        frequency_penalty=0.1,
        logit_bias={"5": 1},
        logprobs=True,
        max_completion_tokens=9,
        max_tokens=4,
        n=3,
        parallel_tool_calls=False,
        presence_penalty=0.2,
        response_format={"type": "text"},
        seed=1,
        service_tier="auto",
        stop="x",
        store=False,
        stream=True,
        stream_options={"include_usage": False},
        temperature=0.0,
        tool_choice="none",
        tools=[],
        top_logprobs=2,
        top_p=0.5,
        user="u",
        modalities=["text"],
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        stop_token_ids=[2],
        ignore_eos=False,
        min_tokens=1,
    )
    assert [m.template_dict() for m in request.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb", "name": "u"},
        {"role": "assistant", "content": ""},
    ]
    assert request.stops == ["x"]
    assert not request.include_usage
    assert request.to_sampling_params(default_max_tokens=100) == SamplingParams(
        max_tokens=9,
        min_tokens=1,
        temperature=0.0,
        top_k=5,
        top_p=0.5,
        min_p=0.1,
        presence_penalty=0.2,
        frequency_penalty=0.1,
        repetition_penalty=1.2,
        logit_bias=((5, 1.0),),
        seed=1,
        stop_token_ids=(2,),
        logprobs=2,
    )


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_response_format_becomes_a_grammar():
    def grammar(response_format, endpoint=ChatCompletionRequest):
        fields = {"messages": MESSAGES} if endpoint is ChatCompletionRequest else {"prompt": "x"}
        request = parse(endpoint, model="m", response_format=response_format, **fields)
        params = request.to_sampling_params(9) if endpoint is ChatCompletionRequest else request.to_sampling_params()
        return params.grammar

    assert grammar({"type": "text"}) is None
    assert grammar({"type": "json_object"}) == Grammar("json_schema", '{"type": "object"}', "response_format")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    expected = Grammar("json_schema", json.dumps(schema), "response_format.json_schema.schema")
    assert grammar({"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}) == expected
    assert grammar({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}, CompletionRequest) == expected


@pytest.mark.parametrize("field,value,grammar", [
    ("guided_json", {"type": "object"}, Grammar("json_schema", '{"type": "object"}', "guided_json")),
    ("guided_json", '{"type": "object"}', Grammar("json_schema", '{"type": "object"}', "guided_json")),
    ("guided_regex", "[0-9]+", Grammar("regex", "[0-9]+", "guided_regex")),
    ("guided_choice", ["yes", "no"], Grammar("lark", 'start: "yes" | "no"', "guided_choice")),
    ("guided_grammar", 'start: "a"', Grammar("lark", 'start: "a"', "guided_grammar")),
])
def test_vllms_older_guided_fields_are_structured_outputs(field, value, grammar):
    assert parse(CompletionRequest, model="m", prompt="x", **{field: value}).to_sampling_params().grammar == grammar
    chat = parse(ChatCompletionRequest, model="m", messages=MESSAGES, **{field: value})
    assert chat.to_sampling_params(9).grammar == grammar


@pytest.mark.parametrize("body,message,param", [
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}},
     "send one constraint on the output, not structured_outputs and guided_regex", "guided_regex"),
    ({"guided_json": {}, "response_format": {"type": "json_object"}},
     "send one constraint on the output, not guided_json and response_format", "response_format"),
    ({"guided_choice": []}, "guided_choice: List should have at least 1 item after validation, not 0",
     "guided_choice"),
    ({"skip_special_tokens": False}, "'skip_special_tokens' is not supported yet; only True is accepted",
     "skip_special_tokens"),
    ({"include_stop_str_in_output": True},
     "'include_stop_str_in_output' is not supported yet; only False is accepted", "include_stop_str_in_output"),
    ({"use_beam_search": True}, "'use_beam_search' is not supported yet; only False is accepted", "use_beam_search"),
    ({"priority": 2}, "'priority' is not supported yet; only 0 is accepted", "priority"),
    ({"best_of_n": 2}, "'best_of_n' is not a supported field; remove it", "best_of_n"),
])
def test_vllm_extras_at_other_values_are_400s(body, message, param):
    assert rejected(CompletionRequest, model="m", prompt="x", **body) == error(message, param)


def test_vllm_extras_at_their_defaults_are_accepted():
    neutral = {"skip_special_tokens": True, "spaces_between_special_tokens": True,
               "include_stop_str_in_output": False, "use_beam_search": False, "priority": 0}
    assert parse(ChatCompletionRequest, model="m", messages=MESSAGES, **neutral).to_sampling_params(9).grammar is None


def test_tool_messages_render_for_templates():
    request = parse(ChatCompletionRequest, model="m", tools=[TOOL], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])
    assert [m.template_dict() for m in request.messages] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    assert request.tool_mode == "auto"
    assert parse(ChatCompletionRequest, model="m", messages=MESSAGES, tools=[TOOL], tool_choice="none").tool_mode == "none"
    assert parse(ChatCompletionRequest, model="m", messages=MESSAGES).tool_mode == "none"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert parse(ChatCompletionRequest, model="m", messages=MESSAGES, tools=[TOOL], tool_choice=named).tool_mode == "function"


def test_an_assistant_message_carries_its_thinking_back_to_the_template():
    def rendered(**fields) -> dict:
        message = {"role": "assistant", "content": None, "tool_calls": [CALL], **fields}
        return parse(ChatCompletionRequest, model="m", messages=[*MESSAGES, message]).messages[1].template_dict()

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    carried = {"role": "assistant", "content": "", "tool_calls": [call],
               "reasoning_content": "Need the weather.", "thinking": "Need the weather."}
    assert rendered(reasoning_content="Need the weather.") == carried  # vLLM's name
    assert rendered(reasoning="Need the weather.") == carried  # OpenRouter's
    assert rendered(reasoning_content="Need the weather.", reasoning="Need the weather.") == carried
    assert rendered(reasoning_content=None) == {"role": "assistant", "content": "", "tool_calls": [call]}


def test_chat_max_tokens_and_logprobs_mapping():
    def params(**body):
        return parse(ChatCompletionRequest, messages=MESSAGES, model="m", **body).to_sampling_params(77)

    assert (params().max_tokens, params().logprobs) == (77, None)
    assert params(max_tokens=5).max_tokens == 5
    assert params(logprobs=True).logprobs == 0
    assert params(logprobs=False).logprobs is None


@pytest.mark.parametrize(
    "body, message, param",
    [
        ({"tools": [{"type": "function"}]}, "tools.0.function: Field required", "tools.0.function"),
        ({"tools": [TOOL, TOOL]}, "tool names must be unique, got ['get_weather', 'get_weather']", "tools"),
        ({"tool_choice": "auto"}, "tool_choice needs tools; declare them in 'tools'", "tool_choice"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice names function 'nope', which is not among the declared tools ['get_weather']",
            "tool_choice",
        ),
        (
            {"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format cannot be combined with a required or named tool_choice: the calls' arguments "
            "already follow the tools' schemas",
            "response_format",
        ),
        ({"functions": [{"name": "f"}]}, "'functions' is not supported yet; only [] is accepted", "functions"),
        ({"function_call": "auto"}, "'function_call' is not supported yet; only 'none' is accepted", "function_call"),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema must be given exactly when type is 'json_schema'",
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name: Field required",
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "xml"}},
            "response_format.type: Input should be 'text', 'json_object' or 'json_schema'",
            "response_format.type",
        ),
        ({"audio": {"voice": "x"}}, "'audio' is not supported yet", "audio"),
        (
            {"modalities": ["text", "audio"]},
            "'modalities' is not supported yet; only ['text'] is accepted",
            "modalities",
        ),
        ({"prediction": {"type": "content"}}, "'prediction' is not supported yet", "prediction"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort: Input should be 'none', 'minimal', 'low', 'medium' or "
         "'high'", "reasoning_effort"),
        ({"store": True}, "'store' is not supported yet; only False is accepted", "store"),
        ({"metadata": {"a": "b"}}, "'metadata' is not supported yet", "metadata"),
        (
            {"service_tier": "flex"},
            "'service_tier' is not supported yet; only 'auto' or 'default' is accepted",
            "service_tier",
        ),
        ({"web_search_options": {}}, "'web_search_options' is not supported yet", "web_search_options"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs=true", "top_logprobs"),
        ({"echo": True}, "'echo' is not a supported field; remove it", "echo"),
        (
            {"max_completion_tokens": 0},
            "max_completion_tokens: Input should be greater than or equal to 1",
            "max_completion_tokens",
        ),
        ({"messages": []}, "messages: List should have at least 1 item after validation, not 0", "messages"),
    ],
)
def test_chat_400s(body, message, param):
    assert rejected(ChatCompletionRequest, **{"messages": MESSAGES, "model": "m", **body}) == error(message, param)


@pytest.mark.parametrize(
    "message, text, param",
    [
        (
            {"role": "tool", "content": "x"},
            "a message with role 'tool' needs the tool_call_id it answers",
            "messages.0.tool_call_id",
        ),
        (
            {"role": "function", "content": "x", "name": "f"},
            "messages with role 'function' (deprecated by OpenAI) are not supported; send role 'tool' with a "
            "tool_call_id",
            "messages.0.role",
        ),
        (
            {"role": "user", "content": "x", "tool_calls": [CALL]},
            "only assistant messages carry tool_calls, not role 'user'",
            "messages.0.tool_calls",
        ),
        (
            {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{oops"}}]},
            "tool call arguments must be JSON text, got '{oops'",
            "messages.0.tool_calls",
        ),
        (
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "u"}}]},
            "content parts of type 'input_audio' are not supported; send text and image_url parts",
            "messages.0.content",
        ),
        (
            {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
            "messages.0.tool_calls.0.function: Field required",
            "messages.0.tool_calls.0.function",
        ),
        (
            {"role": "user", "content": "x", "reasoning_content": "hmm"},
            "only assistant messages carry reasoning_content (the model's earlier thinking), not role 'user'",
            "messages.0.reasoning_content",
        ),
        (
            {"role": "tool", "tool_call_id": "call_1", "content": "x", "reasoning": "hmm"},
            "only assistant messages carry reasoning (the model's earlier thinking), not role 'tool'",
            "messages.0.reasoning",
        ),
        (
            {"role": "assistant", "content": "x", "reasoning_content": "a", "reasoning": "b"},
            "reasoning is another name for reasoning_content and differs from it; send one of them",
            "messages.0.reasoning",
        ),
        ({"role": "robot", "content": "x"}, None, "messages.0.role"),
    ],
)
def test_chat_message_400s(message, text, param):
    body = rejected(ChatCompletionRequest, messages=[message], model="m")
    assert body["error"]["param"] == param
    if text is not None:
        assert body["error"]["message"] == text


# ---- error bodies ----


def test_error_bodies_and_statuses():
    assert (Unauthorized("bad key").status, Unauthorized("bad key").body()) == (
        401,
        {"error": {"message": "bad key", "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}},
    )
    assert (NotFound("no model", "model").status, NotFound("no model", "model").body()) == (
        404,
        {
            "error": {
                "message": "no model",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        },
    )
    overloaded = Overloaded("full", retry_after_s=2.5)
    assert (overloaded.status, overloaded.headers()) == (429, {"Retry-After": "3"})


def test_to_api_error_maps_engine_and_ray_exceptions():
    bad = to_api_error(InvalidRequestError("prompt too long", "prompt"))
    assert (bad.status, bad.body()) == (400, error("prompt too long", "prompt"))
    dead = to_api_error(EngineDeadError("engine loop died: boom"))
    assert (dead.status, dead.code) == (503, "service_unavailable")
    full = to_api_error(
        BackPressureError(num_queued_requests=3, max_queued_requests=2, status_code=429, retry_after_s=4)
    )
    assert (full.status, full.headers(), full.body()["error"]["code"]) == (
        429,
        {"Retry-After": "4"},
        "rate_limit_exceeded",
    )
    gone = to_api_error(ActorDiedError())
    assert (gone.status, gone.code, gone.headers()) == (503, "service_unavailable", {"Retry-After": "1"})
    assert gone.body()["error"]["message"].startswith("the model server stopped while serving this request")
    wrapped = RayTaskError("f", "traceback", BadRequest("from the replica", "n"))
    assert to_api_error(wrapped).body() == error("from the replica", "n")
    other = to_api_error(KeyError("x"))
    assert (other.status, other.body()) == (
        500,
        {
            "error": {
                "message": "internal server error (KeyError); see the server log",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        },
    )


@pytest.mark.parametrize("exc", [BadRequest("m", "p"), Overloaded("m", 7.0), NotFound("m")])
def test_api_errors_survive_pickling(exc: APIError):
    copy = pickle.loads(pickle.dumps(exc))
    assert (type(copy), copy.body(), copy.headers()) == (type(exc), exc.body(), exc.headers())
