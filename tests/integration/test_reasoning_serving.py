"""Reasoning models through the OpenAI API (the official `openai` client against the app in this
process): `reasoning_content` beside `content`, streamed and not; `chat_template_kwargs` and
`reasoning_effort` reaching the chat template; tool calls read from the answer after thinking; a
DeepSeek-R1 style prompt that opens the block, on the real engine."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.support.serving_helpers import app_in_process, templated_checkpoint

MODEL = "thinker"
HISTORY = ("{%- for message in messages %}<|im_start|>{{ message.role }}\n"
           "{%- if message.role == 'assistant' %}{{ message.content.split('</think>')[-1] }}"
           "{%- else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}")
QWEN3_TEMPLATE = (
    "{%- if reasoning_effort %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    + HISTORY + "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
R1_TEMPLATE = HISTORY + "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
THOUGHT, ANSWER = "\nThe capital of France is Paris.\n", "\n\nParis."


def thinking_checkpoint(model_dir, tmp_path_factory, template: str, output: str | None = None):
    """The tiny checkpoint with `template` as its chat template (and, for FixedOutputEngine,
    `output` then end-of-turn as what it says)."""
    ids = None
    if output is not None:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        ids = tokenizer.encode(output, add_special_tokens=False) + [tokenizer.eos_token_id]
    return templated_checkpoint(model_dir, tmp_path_factory.mktemp("thinker"), template, ids)


def serve(checkpoint, engine_cls: str | None = "tests.support.fake_engine:FixedOutputEngine"):
    """The app over `checkpoint` (a model that says its fixed output; None: the real engine)."""
    engine = {} if engine_cls is None else {"engine_cls": engine_cls}
    return app_in_process(checkpoint, MODEL, max_num_seqs=4, **engine)


@pytest.fixture(scope="module")
def app(llama_dir, tmp_path_factory):
    """A Qwen3-style model that always says <think>THOUGHT</think>ANSWER."""
    with serve(thinking_checkpoint(llama_dir, tmp_path_factory, QWEN3_TEMPLATE,
                                   f"<think>{THOUGHT}</think>{ANSWER}")) as app:
        yield app


def test_thinking_comes_apart_from_the_answer(app):
    _, _, client = app
    response = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=100)
    message = response.choices[0].message
    assert (message.reasoning_content, message.content, response.choices[0].finish_reason) == (THOUGHT, ANSWER, "stop")
    tokenizer = AutoTokenizer.from_pretrained(app[0].prompts.hf.name_or_path)
    assert response.usage.completion_tokens == len(tokenizer.encode(f"<think>{THOUGHT}</think>{ANSWER}")) + 1


def test_streamed_thinking_and_answer_join_to_the_whole_response(app):
    _, _, client = app
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=100, stream=True)
    thought = answer = ""
    order = []
    for chunk in stream:
        delta = chunk.choices[0].delta
        thought += getattr(delta, "reasoning_content", None) or ""
        answer += delta.content or ""
        order += ["thought"] * bool(getattr(delta, "reasoning_content", None)) + ["answer"] * bool(delta.content)
    assert (thought, answer) == (THOUGHT, ANSWER)
    assert order == sorted(order, key=lambda kind: kind == "answer")  # all thinking before the answer


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(app):
    server, _, client = app
    tokenizer = server.prompts.hf

    def prompt_tokens(**extra):
        response = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, extra_body=extra)
        return response.usage.prompt_tokens

    want = len(tokenizer.apply_chat_template(ASK, add_generation_prompt=True, enable_thinking=False))
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == want
    want = len(tokenizer.apply_chat_template(ASK, add_generation_prompt=True, reasoning_effort="low"))
    assert prompt_tokens(reasoning_effort="low") == want > prompt_tokens()


def test_with_thinking_closed_in_the_prompt_the_output_is_all_answer(llama_dir, tmp_path_factory):
    """Qwen3's `enable_thinking: false` closes an empty block in the prompt; a `<think>` the model
    then writes mid-answer is text."""
    checkpoint = thinking_checkpoint(llama_dir, tmp_path_factory, QWEN3_TEMPLATE, "Paris <think> x </think>")
    with serve(checkpoint) as (_, _, client):
        message = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=100, extra_body={
            "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert (getattr(message, "reasoning_content", None), message.content) == (None, "Paris <think> x </think>")


@pytest.mark.parametrize("extra,param,message", [
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs",
     "chat_template_kwargs must not set ['tools']: the server renders those from the request's own fields"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort",
     "reasoning_effort: Input should be 'none', 'minimal', 'low', 'medium' or 'high'"),
])
def test_bad_reasoning_fields_are_a_400(app, extra, param, message):
    _, http, _ = app
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **extra})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param) and message in error["message"]


def test_a_prompt_that_opens_the_block_is_read_as_thinking_on_the_real_engine(llama_dir, tmp_path_factory):
    """DeepSeek-R1's template ends the prompt with <think>: the real engine's greedy answer (random
    weights: it never closes the block) is all reasoning, exactly the text /v1/completions gives for
    the rendered prompt; content is null."""
    with serve(thinking_checkpoint(llama_dir, tmp_path_factory, R1_TEMPLATE), engine_cls=None) as (server, _, client):
        chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0.0)
        prompt = server.prompts.hf.apply_chat_template(ASK, add_generation_prompt=True)
        completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.0)
    message = chat.choices[0].message
    assert "</think>" not in completion.choices[0].text
    assert (message.reasoning_content, message.content) == (completion.choices[0].text, None)
    assert chat.choices[0].finish_reason == "length"


def test_tool_calls_are_read_from_the_answer_after_thinking(llama_dir, tmp_path_factory):
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    checkpoint = thinking_checkpoint(llama_dir, tmp_path_factory, QWEN3_TEMPLATE, f"<think>{THOUGHT}</think>{call}")
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    with serve(checkpoint) as (_, _, client):
        choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=[tool], max_tokens=100).choices[0]
    assert (choice.finish_reason, choice.message.reasoning_content, choice.message.content) == (
        "tool_calls", THOUGHT, None)
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_time", '{"zone":"UTC"}')]


def test_a_json_schema_waits_for_the_thinking_on_the_real_engine(llama_dir, tmp_path_factory):
    """Structured output on a reasoning model constrains the answer only: the real engine compiles
    the composed grammar, and the random model (which never closes its thought within 12 tokens)
    is left free to think (in valid UTF-8: the thought is text, so byte tokens that make no
    character are masked); a lark grammar instead applies from the first token (no thinking)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with serve(thinking_checkpoint(llama_dir, tmp_path_factory, R1_TEMPLATE), engine_cls=None) as (_, _, client):
        free = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0.0)
        constrained = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=12, temperature=0.0,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
        forced = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0.0,
                                                extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    free_text = free.choices[0].message.reasoning_content
    assert constrained.choices[0].message.reasoning_content.startswith(free_text.split("\ufffd")[0])
    assert constrained.choices[0].finish_reason == "length" and constrained.choices[0].message.content is None
    assert forced.choices[0].message.content in ("yes", "no")
    assert getattr(forced.choices[0].message, "reasoning_content", None) is None
