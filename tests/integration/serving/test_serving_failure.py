"""End to end, failures: the `failure` app (tests/support/serving_apps.py) on a real local Ray Serve,
a fake engine that fails, hangs or freezes on command; and apps of their own for a replica shut down
with streams open and for models that cannot start. No client is ever left waiting."""

from __future__ import annotations

import concurrent.futures
import contextlib
from pathlib import Path

import httpx
import pytest

from tests.support.fake_engine import FAIL, FAULT_MARK, HANG
from tests.support.serving_apps import FAKES, MESSAGES, MODEL_FAULTY, PROMPT, REPO
from tests.support.serving_helpers import OpenStream, model_server_processes, wait_for


@pytest.fixture(scope="module")
def client(failure_app):
    return failure_app.client


@pytest.fixture(scope="module")
def http(failure_app):
    return failure_app.http


def test_models(client, serving):
    assert [(m.id, m.model_extra["root"]) for m in client.models.list().data] == [(MODEL_FAULTY,
                                                                                  str(serving.checkpoint))]


@pytest.mark.parametrize("fault,cause", [(FAIL, "RuntimeError('simulated device failure')"),
                                         (HANG, "TimeoutError('an engine step has not returned for")])
def test_a_failed_or_hung_engine_ends_every_request_and_its_replica_restarts(serving, failure_app, http, fault, cause):
    """The engine fails (a step raises) or hangs (a step never returns; the 2 s watchdog finds it):
    a stream already running ends with an error event and [DONE], the request that set it off gets a
    503, /health names the model and the cause, Ray Serve restarts the replica, and the next request
    succeeds."""
    from tests.support.serving_helpers import sse_events

    running = OpenStream(http, MODEL_FAULTY, PROMPT, max_tokens=400)
    faulty = http.post("/v1/completions", json={"model": MODEL_FAULTY, "prompt": [FAULT_MARK, fault], "max_tokens": 3})
    assert faulty.status_code == 503
    assert faulty.json()["error"]["message"].startswith(f"engine loop died: {cause}")
    events = sse_events(running.lines)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "service_unavailable"
    assert events[-2]["error"]["message"].startswith(f"engine loop died: {cause}")
    health = httpx.get(f"{failure_app.url}/health")
    if health.status_code == 503:  # else Serve has already replaced the replica
        assert health.json()["error"]["message"].startswith(f"model '{MODEL_FAULTY}' is not ready: ")
    wait_for(lambda: httpx.get(f"{failure_app.url}/health").status_code == 200, 120, "the replica to come back")
    again = http.post("/v1/completions", json={"model": MODEL_FAULTY, "prompt": [5, 6, 7], "max_tokens": 3})
    assert (again.status_code, again.json()["choices"][0]["text"]) == (200, serving.tokenizer.decode([5, 6, 7]))


def test_a_stream_queued_without_output_is_kept_alive(serving, failure_app, http):
    """Eight streams fill the faulty-fake replica's engine (~10 s each); a ninth waits in its queue
    with no output for far longer than the 3 s silence timeout. The replica's keepalives keep it
    open, and it runs to its end once a slot frees."""
    from tests.support.serving_helpers import sse_events

    holders = [OpenStream(http, MODEL_FAULTY, PROMPT) for _ in range(8)]
    try:
        waiting = http.post("/v1/completions", json={"model": MODEL_FAULTY, "prompt": [5, 6, 7], "max_tokens": 3,
                                                     "stream": True})
        events = sse_events(waiting.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == serving.tokenizer.decode([5, 6, 7])
    finally:
        for holder in holders:
            holder.close()


def test_a_frozen_replica_ends_its_streams_and_is_replaced(serving, failure_app, http):
    """SIGSTOP the faulty-fake replica's process with a stream open: nothing, not even a keepalive,
    comes from it, so after 3 s the ingress ends the stream with a 503 error event and [DONE]; Serve
    replaces the frozen replica and requests succeed again."""
    import os
    import signal

    import psutil

    from tests.support.serving_helpers import sse_events

    stream = OpenStream(http, MODEL_FAULTY, PROMPT)
    (replica,) = model_server_processes("failure", MODEL_FAULTY)
    os.kill(replica.pid, signal.SIGSTOP)
    try:
        events = sse_events(stream.lines)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "service_unavailable"
        assert events[-2]["error"]["message"] == ("the model server sent nothing for 3 s, not even a keepalive: it is "
                                                  "stuck or gone; retry")
        # /health waits up to 10 s for each replica's answer: the frozen one's never comes
        wait_for(lambda: httpx.get(f"{failure_app.url}/health", timeout=30).status_code == 200
                 and not replica.is_running(), 240, "Serve to replace the frozen replica")
    finally:
        with contextlib.suppress(psutil.Error):
            replica.send_signal(signal.SIGCONT)
    again = http.post("/v1/completions", json={"model": MODEL_FAULTY, "prompt": [5, 6, 7], "max_tokens": 3})
    assert (again.status_code, again.json()["choices"][0]["text"]) == (200, serving.tokenizer.decode([5, 6, 7]))


def drain_app(checkpoint: Path, graceful_shutdown_timeout_s: float):
    from serve_app import build_app

    model = {"model": str(checkpoint), "model_id": "draining", "engine_cls": f"{FAKES}:SlowFakeEngine",
             "env_vars": {"PYTHONPATH": str(REPO)}, "max_num_seqs": 8, "max_model_len": 4096,
             "num_cpus": 0.1, "stream_batch_ms": 5, "graceful_shutdown_timeout_s": graceful_shutdown_timeout_s}
    return build_app({"models": [model], "ingress_num_cpus": 0.05})


def open_streams(url: str, count: int, max_tokens: int) -> list:
    """`count` streamed completions, each read up to its first event."""
    streams = []
    for _ in range(count):
        response = httpx.Client(timeout=120).send(httpx.Request(
            "POST", f"{url}/v1/completions",
            json={"model": "draining", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
                  "ignore_eos": True, "stream_options": {"include_usage": True}}), stream=True)
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
        streams.append(lines)
    return streams


@pytest.mark.parametrize("timeout_s,max_tokens", [(30, 150), (1, 4000)])
def test_a_replica_shut_down_lets_its_streams_finish_or_ends_them_at_the_timeout(serving, checkpoint_factory,
                                                                                timeout_s, max_tokens):
    """Deleting the app (a replica stopping, as on scale-down or a redeploy) with 4 streams open:
    with time enough (150 tokens at 20 ms a step, 30 s allowed), Serve waits and every stream ends
    with its full length and [DONE] before the replica goes; with 1 s allowed for 4000 tokens, each
    ends early with an OpenAI error event and [DONE]. No client is left waiting."""
    from ray import serve

    from tests.support.serving_helpers import sse_events

    serve.run(drain_app(checkpoint_factory("llama"), timeout_s), name="draining", route_prefix="/draining")
    streams = open_streams(f"{serving.url}/draining", 4, max_tokens)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        deleted = pool.submit(serve.delete, "draining")
        events = [sse_events(lines) for lines in streams]
        deleted.result(timeout=120)
    for stream in events:
        assert stream[-1] == "[DONE]"
        if timeout_s == 30:
            assert stream[-3]["choices"][0]["finish_reason"] == "length"
            assert stream[-2]["usage"]["completion_tokens"] == max_tokens
        else:
            assert stream[-2]["error"]["code"] == "service_unavailable"
            assert stream[-2]["error"]["message"].startswith("the model server stopped while serving this request")


def test_models_that_cannot_start_get_a_503_that_says_why_and_the_others_keep_serving(serving, checkpoint_factory,
                                                                                       tmp_path):
    """An app of four models: a healthy one, one whose replica waits at start until the test opens
    its gate, one whose tokenizer class no transformers knows and one whose
    config.json does not parse. Serve gives up on the last two after one try each
    (`max_constructor_retry_count: 1`; Serve's default is three); requests for
    them get a 503 in OpenAI's shape with Retry-After and the replica's own error, the starting one a
    503 that says so (until its gate opens), the healthy one answers throughout; /health and
    /v1/models show every state."""
    import json
    import shutil

    import openai
    from ray import serve

    from serve_app import build_app

    good = checkpoint_factory("llama")
    bad_tokenizer = Path(shutil.copytree(good, tmp_path / "bad-tokenizer"))
    config = json.loads((bad_tokenizer / "tokenizer_config.json").read_text())
    (bad_tokenizer / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "NoSuchTokenizer"}))
    bad_config = Path(shutil.copytree(good, tmp_path / "bad-config"))
    (bad_config / "config.json").write_text('{"model_type": "llama", ')
    gate = tmp_path / "gate"
    env = {"PYTHONPATH": str(REPO), "JAX_SERVE_TEST_GATE": str(gate)}
    fake = {"engine_cls": f"{FAKES}:FakeEngine", "env_vars": env, "num_cpus": 0.05, "max_model_len": 64}
    models = [{"model": str(good), "model_id": "healthy", **fake},
              {"model": str(good), "model_id": "gated", **fake, "engine_cls": f"{FAKES}:GatedFakeEngine"},
              {"model": str(bad_tokenizer), "model_id": "bad-tokenizer", **fake, "max_constructor_retry_count": 1},
              {"model": str(bad_config), "model_id": "bad-config", **fake, "max_constructor_retry_count": 1}]
    base = f"{serving.url}/startup"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    # serve.run waits for the app to run; with two models that never start it raises once Serve gives up
    deploying = concurrent.futures.ThreadPoolExecutor(1).submit(
        serve.run, build_app({"models": models, "ingress_num_cpus": 0.05}), name="startup", route_prefix="/startup")
    try:
        def states() -> dict:
            try:
                return {m.id: (m.model_extra["state"], m.model_extra["error"]) for m in client.models.list().data}
            except openai.APIError:
                return {}  # the ingress is not up yet

        wait_for(lambda: {s for s, _ in states().values()} == {"ready", "starting", "failed"}
                 and states()["bad-config"][0] == "failed" == states()["bad-tokenizer"][0], 300,
                 "both broken models to fail and the healthy one to run")
        tokenizer_error = "ValueError: Tokenizer class NoSuchTokenizer does not exist or is not currently imported."
        assert states() == {"healthy": ("ready", None), "gated": ("starting", None),
                            "bad-tokenizer": ("failed", tokenizer_error),
                            "bad-config": ("failed", states()["bad-config"][1])}
        assert states()["bad-config"][1].startswith("JSONDecodeError: ")

        for model, message in (("bad-tokenizer", f"model 'bad-tokenizer' failed to start: {tokenizer_error}; fix its "
                                                 "configuration and redeploy"),
                               ("gated", "model 'gated' is starting (loading and compiling); retry shortly")):
            response = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 2})
            assert (response.status_code, response.headers["retry-after"]) == (503, "1")
            assert response.json() == {"error": {"message": message, "type": "server_error", "param": None,
                                                 "code": "service_unavailable"}}
        with pytest.raises(openai.InternalServerError, match="JSONDecodeError"):
            client.chat.completions.create(model="bad-config", messages=MESSAGES, max_tokens=2)
        ok = client.completions.create(model="healthy", prompt=PROMPT, max_tokens=3, temperature=0)
        assert ok.usage.completion_tokens == 3

        health = httpx.get(f"{base}/health")
        assert health.status_code == 503
        assert {m: h["state"] for m, h in health.json()["models"].items()} == {
            "healthy": "ready", "gated": "starting", "bad-tokenizer": "failed", "bad-config": "failed"}
        assert tokenizer_error in health.json()["error"]["message"]

        gate.touch()  # the starting replica finishes its start
        wait_for(lambda: states().get("gated", ("", None))[0] == "ready", 120, "the gated model to start")
        assert client.completions.create(model="gated", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(RuntimeError):  # Serve reports the two it gave up on to the deployer, too
            deploying.result(timeout=300)
    finally:
        gate.touch()
        serve.delete("startup")
