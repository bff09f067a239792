"""The model server and the ingress app in one process, on the fake engine (no Ray).

The fake engine's output repeats the prompt (see tests/support/fake_engine.py), so every expected text,
count and logprob here is exact.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from ray.serve.exceptions import BackPressureError

from serve_app.config import AppConfig
from serve_app.http.backends import LocalBackend
from serve_app.http.ingress import create_app
from serve_app.protocol.chat import ChatCompletionRequest
from serve_app.protocol.completions import CompletionRequest
from serve_app.protocol.context import RequestContext
from serve_app.replicas.generate import TextServer
from tests.support.serving_helpers import held_in_tokenizing, openai_error, sse_events, wait_for

MODEL = "tiny"
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def checkpoint(llama_dir):
    return llama_dir


def make_server(checkpoint, engine: str = "FakeEngine") -> TextServer:
    args = {"model": str(checkpoint), "model_id": MODEL, "engine_cls": f"tests.support.fake_engine:{engine}", "max_num_seqs": 8}
    return TextServer(AppConfig.from_args({**args, "max_model_len": MAX_MODEL_LEN}).models[0])


@pytest.fixture(scope="module")
def server(checkpoint):
    server = make_server(checkpoint)
    yield server
    server.driver.shutdown()


@pytest.fixture(scope="module")
def client(server):
    with TestClient(create_app({MODEL: LocalBackend(server)})) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.tokenizer


def repeat_prompt(prompt_ids: list[int], shift: int, count: int) -> list[int]:
    """What the fake engine generates."""
    return [prompt_ids[(i + shift) % len(prompt_ids)] for i in range(count)]


def complete(client, **body) -> dict:
    response = client.post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def chat(client, **body) -> dict:
    response = client.post("/v1/chat/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream(client, path: str, **body) -> list:
    with client.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response.iter_lines())


def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


# ---- completions ----


def test_completion_text_usage_and_finish_reason(client):
    body = complete(client, prompt="Hello world", max_tokens=5, temperature=0)
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    assert body["choices"] == [
        {"text": "Hello worldHello worldHello", "index": 0, "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"] == usage(2, 5)


def test_batched_prompts_with_n_fan_out_with_seeds(client, tokenizer):
    prompts = ["Hello world", "The quick brown fox"]
    body = complete(client, prompt=prompts, n=2, max_tokens=3, temperature=1.0, seed=10)
    ids = [tokenizer.encode(p) for p in prompts]
    expected = [tokenizer.decode(repeat_prompt(ids[p], 10 + i, 3)) for p in range(2) for i in range(2)]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == expected
    assert body["usage"] == usage(len(ids[0]) + len(ids[1]), 12)


def test_seeded_sampling_reproduces(client):
    first = complete(client, prompt="The quick brown fox", max_tokens=6, temperature=0.8, seed=3)
    again = complete(client, prompt="The quick brown fox", max_tokens=6, temperature=0.8, seed=3)
    other = complete(client, prompt="The quick brown fox", max_tokens=6, temperature=0.8, seed=4)
    assert first["choices"][0]["text"] == again["choices"][0]["text"] != other["choices"][0]["text"]


def test_token_id_prompts(client, tokenizer):
    body = complete(client, prompt=[[20, 21, 22], [30, 31]], max_tokens=4, temperature=0)
    assert [c["text"] for c in body["choices"]] == [
        tokenizer.decode([20, 21, 22, 20]),
        tokenizer.decode([30, 31, 30, 31]),
    ]
    assert body["usage"] == usage(5, 8)


def test_stop_string_across_tokens_cuts_text_and_aborts_the_engine_request(checkpoint):
    server = make_server(checkpoint, "SlowFakeEngine")
    with TestClient(create_app({MODEL: LocalBackend(server)})) as client:
        body = complete(
            client, prompt="Hello world", max_tokens=100, temperature=0, ignore_eos=True, stop=["zz", "ldHe"]
        )
        assert body["choices"][0]["text"] == "Hello wor"
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"] == usage(2, 3)
        wait_for(lambda: server.driver.engine.aborted == [body["id"] + "-0"], what="the engine request to be aborted")
    server.driver.shutdown()


def test_stop_token_ids_end_with_stop_and_count(client, tokenizer):
    body = complete(client, prompt=[40, 41, 42, 43], max_tokens=10, temperature=0, stop_token_ids=[42])
    assert body["choices"][0]["text"] == tokenizer.decode([40, 41, 42])
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == usage(4, 3)


def test_streamed_completion_joins_to_the_full_text(client):
    request = dict(prompt="Hello world", max_tokens=7, temperature=0)
    full = complete(client, **request)
    events = stream(client, "/v1/completions", stream_options={"include_usage": True}, **request)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert {c["id"] for c in chunks} == {usage_chunk["id"]}
    assert all(c["usage"] is None for c in chunks)
    assert (usage_chunk["choices"], usage_chunk["usage"]) == ([], full["usage"])


def test_stream_without_include_usage_has_no_usage_chunk(client):
    events = stream(client, "/v1/completions", prompt="Hello world", max_tokens=2, temperature=0)
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["Hello", " world"]
    assert events[-1] == "[DONE]"


def test_echo_with_logprobs(client):
    body = complete(client, prompt="Hello world", max_tokens=2, temperature=0, echo=True, logprobs=1)
    choice = body["choices"][0]
    assert choice["text"] == "Hello worldHello world"
    assert choice["logprobs"] == {
        "tokens": ["Hello", " world", "Hello", " world"],
        "token_logprobs": [None, -0.25, -0.25, -0.5],
        "top_logprobs": [None, {" world": -0.25}, {"Hello": -0.25}, {" world": -0.5}],
        "text_offset": [0, 5, 11, 16],
    }
    assert body["usage"] == usage(2, 2)


def test_echo_with_zero_max_tokens_scores_the_prompt_only(client):
    body = complete(client, prompt="Hello world", max_tokens=0, temperature=0, echo=True, logprobs=0)
    assert body["choices"][0] == {
        "text": "Hello world",
        "index": 0,
        "logprobs": {
            "tokens": ["Hello", " world"],
            "token_logprobs": [None, -0.25],
            "top_logprobs": [None, {" world": -0.25}],
            "text_offset": [0, 5],
        },
        "finish_reason": "length",
    }
    assert body["usage"] == usage(2, 0)


def test_logprobs_list_the_chosen_token_and_alternatives(client, tokenizer):
    body = complete(client, prompt=[50, 60], max_tokens=2, temperature=0, logprobs=2)
    decode = lambda t: tokenizer.decode([t])  # noqa: E731
    assert body["choices"][0]["logprobs"] == {
        "tokens": [decode(50), decode(60)],
        "token_logprobs": [-0.25, -0.5],
        "top_logprobs": [{decode(50): -0.25, decode(51): -1.25}, {decode(60): -0.5, decode(61): -1.5}],
        "text_offset": [0, len(decode(50))],
    }


# ---- chat ----


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🚀"}]


def chat_prompt_ids(tokenizer) -> list[int]:
    return tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)


def test_chat_uses_the_template_and_stops_at_eos(client, tokenizer):
    prompt = chat_prompt_ids(tokenizer)
    end = prompt.index(tokenizer.eos_token_id) + 1  # the fake repeats the prompt up to its first EOS
    body = chat(client, messages=MESSAGES, temperature=0)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "system\nBe brief."},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert tokenizer.decode(prompt[:end], skip_special_tokens=True) == "system\nBe brief."
    assert body["usage"] == usage(len(prompt), end)


def test_chat_max_tokens_and_n(client, tokenizer):
    body = chat(client, messages=MESSAGES, temperature=0, max_completion_tokens=2, n=3)
    text = tokenizer.decode(chat_prompt_ids(tokenizer)[:2], skip_special_tokens=True)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (i, text, "length") for i in range(3)
    ]
    assert body["usage"]["completion_tokens"] == 6


def test_streamed_chat_sends_role_first_and_finish_last(client):
    full = chat(client, messages=MESSAGES, temperature=0)
    events = stream(client, "/v1/chat/completions", messages=MESSAGES, temperature=0)
    chunks = events[:-1]
    assert events[-1] == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert [d["role"] for d in deltas] == ["assistant"] + [None] * (len(deltas) - 1)
    assert "".join(d["content"] for d in deltas) == full["choices"][0]["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-2:] == [None, "stop"]


def test_chat_logprobs_with_bytes_and_top_logprobs(client, tokenizer):
    body = chat(client, messages=MESSAGES, temperature=0, max_tokens=2, logprobs=True, top_logprobs=2)
    first, second = chat_prompt_ids(tokenizer)[:2]
    content = body["choices"][0]["logprobs"]["content"]
    entry = lambda t, lp: {"token": tokenizer.decode([t]), "logprob": lp, "bytes": list(tokenizer.decode([t]).encode())}  # noqa: E731
    assert content == [
        {**entry(first, -0.25), "top_logprobs": [entry(first, -0.25), entry(first + 1, -1.25)]},
        {**entry(second, -0.5), "top_logprobs": [entry(second, -0.5), entry(second + 1, -1.5)]},
    ]


# ---- errors ----


def post_error(client, path: str, body: dict, status: int) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    return response.json()


def test_prompt_that_does_not_fit_is_a_400_with_the_numbers(client):
    body = post_error(client, "/v1/completions", {"model": MODEL, "prompt": [1] * 100, "max_tokens": 50}, 400)
    assert body == openai_error(
        "This model's maximum context length is 128 tokens. However, you requested 150 tokens (100 in the prompt, "
        "50 for the completion). Please reduce the length of the prompt or of max_tokens.",
        "max_tokens",
    )


def test_chat_prompt_longer_than_the_context_is_a_400(client):
    messages = [{"role": "user", "content": "Hello world " * 80}]
    body = post_error(client, "/v1/chat/completions", {"model": MODEL, "messages": messages}, 400)
    assert body["error"]["message"].startswith("This model's maximum context length is 128 tokens. However, you "
                                               "requested ")
    assert body["error"]["param"] == "max_tokens"


@pytest.mark.parametrize(
    "body, message, param",
    [
        ({"prompt": [5, 9999]}, "prompt holds token ids outside the vocabulary [0, 492): [9999]", "prompt"),
        (
            {"prompt": "x", "logit_bias": {"-1": 1}},
            "logit_bias holds token ids outside the vocabulary [0, 492): [-1]",
            "logit_bias",
        ),
        (
            {"prompt": "x", "stop_token_ids": [492]},
            "stop_token_ids holds token ids outside the vocabulary [0, 492): [492]",
            "stop_token_ids",
        ),
        ({"prompt": ""}, "prompt must not be empty", "prompt"),
        ({"prompt": "x", "suffix": "y"}, "'suffix' is not supported yet", "suffix"),
        ({"prompt": "x", "temperature": -2}, "temperature must be non-negative", "temperature"),
    ],
)
def test_completion_400_bodies(client, body, message, param):
    assert post_error(client, "/v1/completions", {"model": MODEL, **body}, 400) == openai_error(message, param)


def test_invalid_json_is_a_400(client):
    response = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("Invalid JSON")


def test_unknown_model_is_a_404(client):
    expected = openai_error(
        "the model 'gpt-4' does not exist; served models: ['tiny']", "model", code="model_not_found"
    )
    assert post_error(client, "/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404) == expected
    response = client.get("/v1/models/gpt-4")
    assert (response.status_code, response.json()) == (404, expected)


def test_unknown_route_and_wrong_method(client):
    response = client.get("/v1/nothing")
    assert (response.status_code, response.json()) == (
        404,
        openai_error("no route GET /v1/nothing", code="unknown_url"),
    )
    response = client.get("/v1/completions")
    assert (response.status_code, response.json()) == (405, openai_error("method not allowed: GET /v1/completions"))


def test_api_key(server):
    with TestClient(create_app({MODEL: LocalBackend(server)}, api_key="sesame")) as client:
        request = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
        missing = client.post("/v1/completions", json=request)
        wrong = client.post("/v1/completions", json=request, headers={"Authorization": "Bearer nope"})
        right = client.post("/v1/completions", json=request, headers={"Authorization": "Bearer sesame"})
        models = client.get("/v1/models")
        assert (missing.status_code, missing.json()) == (
            401,
            openai_error("no API key provided; send it as 'Authorization: Bearer <key>'", code="invalid_api_key"),
        )
        assert (wrong.status_code, wrong.json()) == (
            401,
            openai_error("incorrect API key provided", code="invalid_api_key"),
        )
        assert right.status_code == 200
        assert models.status_code == 401
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200


class FailingBackend(LocalBackend):
    """A backend whose calls raise `exc` (what a Ray handle raises when the queue is full, ...)."""

    def __init__(self, exc: Exception):
        super().__init__(None)
        self.exc = exc

    async def respond(self, request, context):
        raise self.exc

    async def stream(self, request, context):
        raise self.exc
        yield


def test_full_queue_is_a_429_with_retry_after():
    full = BackPressureError(num_queued_requests=4, max_queued_requests=4, status_code=429, retry_after_s=2)
    with TestClient(create_app({MODEL: FailingBackend(full)})) as client:
        for stream_flag in (False, True):
            response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": stream_flag})
            assert response.status_code == 429
            assert response.headers["retry-after"] == "2"
            assert response.json() == openai_error(
                "the server is at capacity (Request dropped due to backpressure (num_queued_requests=4, "
                "max_queued_requests=4).); retry later",
                type="rate_limit_error",
                code="rate_limit_exceeded",
            )


def test_unexpected_exception_is_a_500():
    with TestClient(create_app({MODEL: FailingBackend(ZeroDivisionError("boom"))})) as client:
        response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert (response.status_code, response.json()) == (
        500,
        openai_error("internal server error (ZeroDivisionError); see the server log", type="server_error"),
    )


def test_engine_death_mid_stream_sends_an_error_event_and_health_turns_503(checkpoint):
    server = make_server(checkpoint, "CrashingFakeEngine")
    with TestClient(create_app({MODEL: LocalBackend(server)})) as client:
        assert client.get("/health").status_code == 200
        events = stream(client, "/v1/completions", prompt="Hello world", max_tokens=50, temperature=0, ignore_eos=True)
        texts = [e["choices"][0]["text"] for e in events[:-2]]
        assert texts == ["Hello", " world", "Hello"]  # three steps, then the engine died
        dead = "engine loop died: RuntimeError('simulated device failure')"
        unavailable = openai_error(
            f"{dead}; the model server is restarting, retry shortly", type="server_error", code="service_unavailable"
        )
        assert events[-2:] == [unavailable, "[DONE]"]
        health = client.get("/health")
        problem = "model 'tiny' is not ready: RuntimeError('simulated device failure')"
        assert (health.status_code, health.json()) == (
            503,
            {**openai_error(problem, type="server_error", code="service_unavailable"),
             "models": {"tiny": {"state": "starting", "error": "RuntimeError('simulated device failure')"}}},
        )
        response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert response.status_code == 503
        assert response.json()["error"]["message"].startswith(
            "engine loop died: RuntimeError('simulated device failure')"
        )


# ---- aborts, metrics, models ----


def test_closing_a_stream_aborts_every_choice_and_frees_the_kv_cache(checkpoint):
    server = make_server(checkpoint, "SlowFakeEngine")
    request = CompletionRequest(model=MODEL, prompt="Hello world", n=3, max_tokens=100, ignore_eos=True, stream=True)

    async def read_one_batch_then_leave():
        chunks = server.stream_chunks(request, RequestContext(time.time()))
        first = await anext(chunks)
        await chunks.aclose()
        assert server.driver.num_callers() == 0  # every choice let go within aclose, not when collected later
        return first

    assert len(asyncio.run(read_one_batch_then_leave())) >= 1
    wait_for(lambda: len(server.driver.engine.aborted) == 3, what="three aborts")
    assert sorted(r.rsplit("-", 1)[1] for r in server.driver.engine.aborted) == ["0", "1", "2"]
    stats = wait_for(lambda: (s := server.driver.stats()).num_running == 0 and s, what="an idle engine")
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    server.driver.shutdown()


def test_a_request_being_tokenized_does_not_hold_up_the_streams_of_others(checkpoint, tokenizer):
    """Requests are prepared (chat template, tokenizing, a grammar's compile) off the event loop:
    while one is held inside its tokenizing, a running stream goes on delivering; then the held
    one is answered in full."""
    server = make_server(checkpoint, "SlowFakeEngine")
    running = CompletionRequest(model=MODEL, prompt="Hello world", max_tokens=100, ignore_eos=True, stream=True)
    held = CompletionRequest(model=MODEL, prompt="Held back", max_tokens=2, ignore_eos=True, temperature=0)

    async def scenario(entered, release):
        chunks = server.stream_chunks(running, RequestContext(time.time()))
        await anext(chunks)
        answer = asyncio.create_task(server.respond(held, RequestContext(time.time())))
        assert await asyncio.to_thread(entered.wait, 30)
        delivered = await anext(chunks)  # while the other request is still held in its tokenizing
        release.set()
        body = json.loads(await answer)
        await chunks.aclose()
        return delivered, body

    with held_in_tokenizing(server.prompts, "Held back") as events:
        delivered, body = asyncio.run(scenario(*events))
    assert len(delivered) >= 1 and json.loads(delivered[0])["choices"][0]["text"]
    ids = tokenizer.encode("Held back")
    assert body["choices"][0]["text"] == tokenizer.decode(repeat_prompt(ids, 0, 2))
    assert body["usage"] == usage(len(ids), 2)
    server.driver.shutdown()


def metric_samples(text: str) -> dict[tuple, float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[
                (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "replica"))))
            ] = s.value
    return samples


def test_metrics_count_requests_tokens_and_reasons(checkpoint):
    server = make_server(checkpoint)
    with TestClient(create_app({MODEL: LocalBackend(server)})) as client:
        for _ in range(3):
            complete(client, prompt="Hello world", max_tokens=4, temperature=0)
        complete(client, prompt=[7, 2], max_tokens=4, temperature=0)  # 2 is EOS: stops after 2 tokens
        chat(client, messages=MESSAGES, temperature=0, max_tokens=1, n=2)
        response = client.get("/metrics")
    server.driver.shutdown()
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = metric_samples(response.text)
    prompt = len(chat_prompt_ids(server.tokenizer))
    assert samples[("vllm:request_success_total", (("finished_reason", "length"),))] == 5
    assert samples[("vllm:request_success_total", (("finished_reason", "stop"),))] == 1
    assert samples[("vllm:prompt_tokens_total", ())] == 3 * 2 + 2 + 2 * prompt
    assert samples[("vllm:generation_tokens_total", ())] == 3 * 4 + 2 + 2
    assert samples[("vllm:e2e_request_latency_seconds_count", ())] == 6
    assert samples[("vllm:time_to_first_token_seconds_count", ())] == 6
    assert samples[("vllm:inter_token_latency_seconds_count", ())] == 3 * 3 + 1
    assert samples[("vllm:request_queue_time_seconds_count", ())] == 6
    assert samples[("vllm:prefix_cache_queries_total", ())] == 3 * 2 + 2 + 2 * prompt
    assert samples[("vllm:max_batch_size", ())] == 2
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert samples[(gauge, ())] == 0
    assert 'replica="local"' in response.text and 'model_name="tiny"' in response.text


def test_models_and_health(client):
    assert client.get("/health").json() == {"status": "ok", "models": {MODEL: {"state": "ready", "replicas": 1}}}
    models = client.get("/v1/models").json()
    assert [(m["id"], m["object"], m["owned_by"]) for m in models["data"]] == [(MODEL, "model", "jax-serve")]
    assert models["object"] == "list"
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL


def test_chat_request_objects_pass_to_the_server_directly(server):
    request = ChatCompletionRequest(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=1)
    body = json.loads(asyncio.run(server.respond(request, RequestContext(time.time()))))
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 1


def imported_after(statement: str, modules: tuple[str, ...]) -> list[str]:
    """Which of `modules` a fresh interpreter has imported after running `statement`."""
    code = f"import sys; {statement}; print(','.join(m for m in {modules!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return [m for m in out.strip().split(",") if m]


def test_the_serving_layer_never_imports_jax():
    statement = "import serve_app.app, serve_app.replicas.generate, serve_app.http.ingress; from serve_app import build_app"
    assert imported_after(statement, ("jax", "jaxlib")) == []


def test_the_ingress_does_not_load_transformers():
    assert imported_after("import serve_app.http.ingress", ("transformers", "torch", "jax")) == []


def test_building_the_app_does_not_load_transformers():
    """`serve run` builds the app in a task of its own before any replica starts: importing the
    builder stays off transformers (a model server imports it when it loads its tokenizer)."""
    assert imported_after("from serve_app import build_app", ("transformers", "torch", "jax")) == []


def test_engine_niceness_applies_to_threads_started_afterwards():
    """Linux niceness is per thread: the replica sets it before the engine starts its threads."""
    import os
    import threading

    from serve_app.replicas.base import set_thread_niceness

    seen = {}

    def replica_init():
        set_thread_niceness(5)
        child = threading.Thread(target=lambda: seen.update(child=os.getpriority(os.PRIO_PROCESS, 0)))
        child.start()
        child.join()
        seen["own"] = os.getpriority(os.PRIO_PROCESS, 0)

    before = os.getpriority(os.PRIO_PROCESS, 0)
    init = threading.Thread(target=replica_init)
    init.start()
    init.join()
    assert seen == {"own": 5, "child": 5}
    assert os.getpriority(os.PRIO_PROCESS, 0) == before, "only the calling thread (and its children) change"


def test_open_streams_share_the_chunk_rate_and_are_counted_back_down(client, server):
    """stream_chunks_per_s bounds a replica's chunks per second: each of S open streams waits
    S / rate between chunks (at least stream_batch_ms). A finished stream no longer counts."""
    events = stream(client, "/v1/completions", prompt="hello", max_tokens=5)
    assert events[-1] == "[DONE]"
    pacing = server.pacing
    assert pacing.open_streams == 0
    rate, floor = pacing.chunks_per_s, pacing.min_interval_s
    pacing.open_streams = 40
    try:
        assert pacing.interval() == pytest.approx(max(floor, 40 / rate))
    finally:
        pacing.open_streams = 0


def test_a_request_to_a_stopping_replica_is_a_503_with_retry_after(checkpoint):
    """After its engine has shut down (the replica is stopping), a request Serve still routes to it
    gets a 503 that tells the client to retry: another replica, or the restarted one, takes it."""
    server = make_server(checkpoint)
    server.driver.shutdown()
    with TestClient(create_app({MODEL: LocalBackend(server)})) as client:
        response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert (response.status_code, response.headers["retry-after"]) == (503, "1")
    assert response.json()["error"]["message"].startswith("engine loop died: RuntimeError('the engine was shut down')")
    assert response.json()["error"]["code"] == "service_unavailable"


def test_health_reports_the_least_compiled_live_replica():
    from serve_app.http.routes.health import model_health

    statuses = [{"alive": True, "compiled_programs": 3, "step_programs": 8},
                {"alive": True, "compiled_programs": 8, "step_programs": 8},
                {"alive": False, "compiled_programs": 1, "step_programs": 8}, TimeoutError("no answer")]
    assert model_health(statuses) == {"replicas": 2, "compiled_programs": 3, "step_programs": 8}
    assert model_health([{"alive": True, "compiled_programs": 0, "step_programs": 0}]) == {"replicas": 1}
