"""End to end, text: the `text` app (tests/support/serving_apps.py) on a real local Ray Serve, the
real engine on a tiny random checkpoint beside fake engines, driven through HTTP by the official
`openai` client (and httpx where exact bytes matter). Reference outputs come from transformers
running the same checkpoint (greedy decoding and prompt logprobs)."""

from __future__ import annotations

import concurrent.futures
import re

import httpx
import pytest

from tests.support.serving_apps import (
    API_KEY,
    MAX_MODEL_LEN,
    MAX_ONGOING,
    MAX_QUEUED,
    MESSAGES,
    MODEL,
    MODEL_PAIR,
    MODEL_SLOW,
    PROMPT,
)
from tests.support.serving_helpers import (
    OpenStream,
    metric,
    model_server_processes,
    openai_error,
    wait_for,
)

openai = pytest.importorskip("openai")

EXTRA = 14


@pytest.fixture(scope="module")
def client(text_app):
    return text_app.client


@pytest.fixture(scope="module")
def http(text_app):
    return text_app.http


def idle(http) -> bool:
    """MODEL's engine runs nothing and has nothing waiting."""
    return metric(http, "vllm:num_requests_running", MODEL) == metric(http, "vllm:num_requests_waiting", MODEL) == 0


# ---- completions and chat ----


def test_completion_matches_transformers_with_exact_usage(serving, client):
    prompt_ids = serving.tokenizer.encode(PROMPT)
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.choices[0].text == serving.greedy_text(prompt_ids, 8)
    assert response.choices[0].finish_reason == "length"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (
        len(prompt_ids),
        8,
        len(prompt_ids) + 8,
    )


def test_list_of_prompts_gives_one_choice_each(serving, client):
    prompts = [PROMPT, "Hello, world!"]
    response = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    expected = [serving.greedy_text(serving.tokenizer.encode(p), 5) for p in prompts]
    assert [(c.index, c.text) for c in response.choices] == list(enumerate(expected))
    assert response.usage.prompt_tokens == sum(len(serving.tokenizer.encode(p)) for p in prompts)
    assert response.usage.completion_tokens == 10


def test_chat_matches_transformers_with_the_template_and_usage(serving, client):
    prompt_ids = serving.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == serving.greedy_text(prompt_ids, 6)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt_ids), 6)


def test_streamed_completion_equals_the_full_one(client):
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**request)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **request))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.model_dump() == full.usage.model_dump()


def test_streamed_chat_equals_the_full_one(client):
    request = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(stream=True, **request))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


def test_n_choices_use_seed_plus_index_and_reproduce(client):
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    several = client.completions.create(n=3, seed=7, **request)
    again = client.completions.create(n=3, seed=7, **request)
    singles = [client.completions.create(seed=7 + i, **request).choices[0].text for i in range(3)]
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert [c.text for c in several.choices] == [c.text for c in again.choices] == singles
    assert several.usage.completion_tokens == 24


def test_stop_strings_cut_the_text(serving, client):
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**request).choices[0].text
    stop = text[6:9]
    response = client.completions.create(stop=["never in this text \u2603", stop], **request)
    assert response.choices[0].text == text[: text.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_completion_logprobs_shapes(client):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert len(logprobs.text_offset) == 6 and logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 2  # greedy: the chosen token is one of the two most likely
        assert top[token] == logprob == max(top.values())


def test_chat_logprobs_shapes(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert len(entry.top_logprobs) == 3
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (entry.token, entry.logprob)
        assert isinstance(entry.bytes, list)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt_like_transformers(serving, client, max_tokens):
    prompt_ids = serving.tokenizer.encode(PROMPT)
    response = client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=max_tokens, temperature=0, echo=True, logprobs=1
    )
    logprobs = response.choices[0].logprobs
    assert response.choices[0].text.startswith(PROMPT)
    assert len(logprobs.tokens) == len(prompt_ids) + max_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    reference = serving.prompt_logprobs(prompt_ids)
    assert logprobs.token_logprobs[1 : len(prompt_ids)] == pytest.approx(reference, abs=1e-3)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt_ids), max_tokens)


def test_models(client, serving):
    assert [m.id for m in client.models.list().data] == [MODEL, MODEL_SLOW, MODEL_PAIR]
    assert client.models.retrieve(MODEL).id == MODEL
    roots = {m.id: m.model_extra["root"] for m in client.models.list().data}
    assert roots == dict.fromkeys([MODEL, MODEL_SLOW, MODEL_PAIR], str(serving.checkpoint))
    assert {m.id: m.task for m in client.models.list().data} == dict.fromkeys([MODEL, MODEL_SLOW, MODEL_PAIR],
                                                                               "generate")
    facts = {m.id: (m.model_extra["max_model_len"], m.model_extra["sampling_defaults"])
             for m in client.models.list().data}
    assert facts == dict.fromkeys([MODEL, MODEL_SLOW, MODEL_PAIR], (MAX_MODEL_LEN, {}))  # a replica's, over Ray


def test_json_schema_and_a_named_tool_call_through_ray_serve(client):
    """Constrained decoding on the real replica (the random model says garbage otherwise)."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "n": {"type": "integer",
              "minimum": 0, "maximum": 9}}, "required": ["city", "n"], "additionalProperties": False}
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=3, temperature=1.0, n=2,
                                            max_tokens=40, response_format={
                                                "type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    for choice in answer.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)
    tool = {"type": "function", "function": {"name": "pick", "parameters": schema}}
    call = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[tool], seed=4, temperature=1.0,
                                          max_tokens=40, tool_choice={"type": "function", "function": {"name": "pick"}})
    assert call.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.choices[0].message.tool_calls[0].function.arguments), schema)


def test_400_for_a_prompt_that_does_not_fit(http):
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 510, "max_tokens": 10})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert "510" in error["message"] and str(MAX_MODEL_LEN) in error["message"]


def test_400_for_unsupported_fields(http):
    response = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "audio": {"voice": "alloy"}}
    )
    assert (response.status_code, response.json()) == (
        400,
        openai_error("'audio' is not supported yet", "audio"),
    )


def test_401_without_the_right_key(text_app):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(f"{text_app.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{text_app.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_404_for_an_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-5", prompt="x")
    assert info.value.status_code == 404
    assert info.value.body == {
        "message": f"the model 'gpt-5' does not exist; served models: ['{MODEL_PAIR}', '{MODEL_SLOW}', '{MODEL}']",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_429_with_retry_after_when_the_queue_is_full(http):
    """Ray Serve's backpressure through the ingress. The slot holders run on the slow fake engine
    (~10 s for 480 tokens), so they outlast the burst on any machine."""
    streams = [OpenStream(http, MODEL_SLOW, PROMPT) for _ in range(MAX_ONGOING)]  # every slot of the replica is busy
    try:
        with concurrent.futures.ThreadPoolExecutor(EXTRA) as pool:
            futures = [
                pool.submit(http.post, "/v1/completions", json={"model": MODEL_SLOW, "prompt": PROMPT, "max_tokens": 2})
                for _ in range(EXTRA)
            ]
            # At most MAX_QUEUED wait in the queue; the others are turned away at once.
            wait_for(lambda: sum(f.done() for f in futures) >= EXTRA - MAX_QUEUED, 60, "the rejections")
            for stream in streams:
                stream.close()  # frees the slots: the queued requests run
            responses = [f.result() for f in futures]
    finally:
        for stream in streams:
            stream.close()
    rejected = [r for r in responses if r.status_code == 429]
    assert len(rejected) >= EXTRA - MAX_QUEUED
    assert all(r.status_code == 200 for r in responses if r not in rejected)
    for response in rejected:
        assert response.headers["retry-after"] == "1"
        assert response.json() == openai_error(
            "the server is at capacity (Request dropped due to backpressure (num_queued_requests=8, "
            "max_queued_requests=8).); retry later",
            type="rate_limit_error",
            code="rate_limit_exceeded",
        )


def test_a_disconnected_stream_is_aborted_and_frees_its_kv_pages(http):
    # Streams an earlier test closed are counted as Ray tears them down: take the baseline once the
    # engine is idle (a closed stream's abort is counted before its engine request ends).
    wait_for(lambda: idle(http), 60, "an idle engine")
    aborted_before = metric(http, "vllm:request_success_total", MODEL, finished_reason="abort")
    stream = OpenStream(http, MODEL, PROMPT)
    assert metric(http, "vllm:kv_cache_usage_perc", MODEL) > 0
    stream.close()
    wait_for(
        lambda: metric(http, "vllm:request_success_total", MODEL, finished_reason="abort") == aborted_before + 1,
        60,
        "the abort to be counted",
    )
    wait_for(lambda: metric(http, "vllm:kv_cache_usage_perc", MODEL) == 0, 60, "all KV pages to be free")
    assert metric(http, "vllm:num_requests_running", MODEL) == 0


def test_metrics_count_requests_and_tokens(serving, http):
    before = {
        "length": metric(http, "vllm:request_success_total", MODEL, finished_reason="length"),
        "prompt": metric(http, "vllm:prompt_tokens_total", MODEL),
        "generated": metric(http, "vllm:generation_tokens_total", MODEL),
        "e2e": metric(http, "vllm:e2e_request_latency_seconds_count", MODEL),
        "ttft": metric(http, "vllm:time_to_first_token_seconds_count", MODEL),
        "itl": metric(http, "vllm:inter_token_latency_seconds_count", MODEL),
        "queue": metric(http, "vllm:request_queue_time_seconds_count", MODEL),
    }
    for _ in range(3):
        response = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True}
        )
        assert response.status_code == 200
    prompt_tokens = len(serving.tokenizer.encode(PROMPT))
    assert metric(http, "vllm:request_success_total", MODEL, finished_reason="length") == before["length"] + 3
    assert metric(http, "vllm:prompt_tokens_total", MODEL) == before["prompt"] + 3 * prompt_tokens
    assert metric(http, "vllm:generation_tokens_total", MODEL) == before["generated"] + 15
    assert metric(http, "vllm:e2e_request_latency_seconds_count", MODEL) == before["e2e"] + 3
    assert metric(http, "vllm:time_to_first_token_seconds_count", MODEL) == before["ttft"] + 3
    # every token after the first
    assert metric(http, "vllm:inter_token_latency_seconds_count", MODEL) == before["itl"] + 3 * 4
    assert metric(http, "vllm:request_queue_time_seconds_count", MODEL) == before["queue"] + 3
    assert metric(http, "vllm:prefix_cache_queries_total", MODEL) > 0
    assert metric(http, "vllm:num_requests_waiting", MODEL) == metric(http, "vllm:num_requests_running", MODEL) == 0
    assert metric(http, "vllm:kv_cache_usage_perc", MODEL) == 0


def test_concurrent_requests_share_engine_steps(http):
    """Six streams through Ray Serve to one replica, each past its first token and far from its
    480th (the slow fake engine: ~10 s each), are one batch: the engine's next step runs all six.
    Closing them frees every slot and page. (Six, not the replica's eight slots: with eight, Serve
    held the eighth back until one ended, once earlier tests had run; seen, not yet explained.)"""
    streams = [OpenStream(http, MODEL_SLOW, PROMPT) for _ in range(6)]
    try:
        wait_for(lambda: metric(http, "vllm:num_requests_running", MODEL_SLOW) == 6, 30, "all six to run")
        steps = metric(http, "vllm:engine_steps_total", MODEL_SLOW)
        wait_for(lambda: metric(http, "vllm:engine_steps_total", MODEL_SLOW) > steps, 30, "a step after all started")
        assert metric(http, "vllm:last_batch_size", MODEL_SLOW) == 6
    finally:
        for stream in streams:
            stream.close()
    wait_for(lambda: metric(http, "vllm:num_requests_running", MODEL_SLOW) == 0
             and metric(http, "vllm:kv_cache_usage_perc", MODEL_SLOW) == 0, 30, "the closed streams' requests to end")


def test_health_needs_no_key_and_reports_the_step_programs_compiled(text_app, http):
    """The real replica serves from its first step program and compiles the other six of its
    ladder (1, 8, ..., 256 tokens) in the background; /health and /metrics say how far it is."""
    response = httpx.get(f"{text_app.url}/health")
    assert response.status_code == 200
    models = response.json()["models"]
    assert models[MODEL]["replicas"] == 1 and models[MODEL]["step_programs"] == 7
    assert models[MODEL_SLOW] == {"state": "ready", "replicas": 1}  # a fake engine compiles nothing ahead
    wait_for(lambda: httpx.get(f"{text_app.url}/health").json()["models"][MODEL]["compiled_programs"] == 7, 300,
             "every step program")
    compiled = metric(http, "jax_serve:compiled_step_programs", MODEL)
    assert compiled == metric(http, "jax_serve:step_programs", MODEL) == 7


def test_a_soak_of_mixed_requests_loses_nothing_and_leaves_every_replica_idle(text_app, http):
    """benchmarks/soak.py in-process on the tiny model: 300 requests at concurrency 32 (completions and
    chat, streamed or not, 60 with n=3, 75 with logprobs; 30 streams of 128 tokens the client closes
    after 1 to 3 events, 30 requests it gives up on after at most 0.1 s). Beyond 8 ongoing + 8 queued, Ray Serve
    answers 429: the soak retries after Retry-After, so every request runs. No 5xx, every stream
    not cut ends with [DONE], usage agrees with the tokens returned, and afterwards every replica of
    every model is back to 0 running, 0 waiting, 0 KV pages held."""
    import asyncio

    from benchmarks.soak import SoakConfig, format_report, soak

    pids = [p.pid for p in model_server_processes("text", MODEL)]
    assert len(pids) == 1
    wait_for(lambda: idle(http), 60, "an idle engine")  # so that the server's counts below are the soak's alone
    config = SoakConfig(base_url=text_app.url, model=MODEL, api_key=API_KEY, requests=300, concurrency=32,
                        max_tokens=8, disconnect_fraction=0.1, timeout_fraction=0.1, multi_fraction=0.2, n=3,
                        logprobs_fraction=0.25, client_timeout_s=0.1, retry_429=True, seed=0, pids=pids)
    report = asyncio.run(soak(config))
    print(format_report(report))
    assert report.actions == {"disconnect": 30, "normal": 240, "timeout": 30}
    assert sum(report.kinds.values()) == 300 and report.multi_choice == 60
    assert sum(count for kind, count in report.kinds.items() if kind.endswith("-stream")) == 30 + 135
    assert sum(count for kind, count in report.kinds.items() if kind.startswith("chat")) == 150
    by_action = report.outcomes_by_action()
    assert by_action["normal"] == {"ok": 240}
    # a cut or a timeout can come after the answer is complete: then it is checked like any other
    assert set(by_action["disconnect"]) <= {"ok", "disconnected"} and sum(by_action["disconnect"].values()) == 30
    assert set(by_action["timeout"]) <= {"ok", "timed_out"} and sum(by_action["timeout"].values()) == 30
    assert report.failures == [] and report.exit_code == 0
    assert report.idle is True and report.busy == []
    assert f"{MODEL}/" in " ".join(report.idle_series)
    assert set(report.memory_before) == set(report.memory_after) == {f"pid {pids[0]}"}
    # every choice of a request the client did not cut finished on the server; no other request did
    finished = report.server_finished
    assert set(finished) <= {"length", "abort"}
    assert sum(r.n for r in report.results if r.action == "normal") <= finished["length"]
    assert sum(finished.values()) <= sum(r.n for r in report.results)


def requests_by_replica(http, model_id: str) -> dict[str, float]:
    """Finished requests of `model_id` per replica, from the app's /metrics."""
    counts: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("vllm:e2e_request_latency_seconds_count{") and f'model_name="{model_id}"' in line:
            replica = re.search(r'replica="([^"]+)"', line).group(1)
            counts[replica] = counts.get(replica, 0) + float(line.rsplit(" ", 1)[1])
    return counts


def test_each_turn_of_a_conversation_goes_to_the_replica_that_served_its_earlier_turns(http):
    """Two replicas behind the prefix-affinity router: a conversation's first turn goes where the
    power of two choices sends it, every later turn (its prompt extends the earlier ones) to the
    same replica. Left to chance, 4 conversations of 3 turns would stay together 1 time in 256."""
    system = "You answer questions about paged attention, page tables and prefix caches, briefly. " * 2
    for conversation in range(4):
        messages = [{"role": "system", "content": f"[{conversation}] {system}"}]
        before = requests_by_replica(http, MODEL_PAIR)
        for turn in range(3):
            messages.append({"role": "user", "content": f"Question {turn} of conversation {conversation}?"})
            answer = http.post("/v1/chat/completions", json={"model": MODEL_PAIR, "messages": messages,
                                                              "max_tokens": 6, "temperature": 0})
            assert answer.status_code == 200, answer.text
            messages.append({"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]})
        after = requests_by_replica(http, MODEL_PAIR)
        served = sorted(after[r] - before.get(r, 0) for r in after)
        assert served[-1] == 3 and sum(served) == 3, (conversation, before, after)
