"""benchmarks/soak.py without a server: the plan, the usage check, /metrics parsing, the report and
its exit code, and whole runs against an in-memory OpenAI-shaped fake (an httpx MockTransport).
Fast (about a second)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from benchmarks import soak as sk

# ---- the plan ----


def config(**overrides) -> sk.SoakConfig:
    return sk.SoakConfig(**{"base_url": "http://fake", "model": "m", "requests": 300, "concurrency": 8, **overrides})


def test_the_plan_has_exact_counts_and_depends_only_on_the_seed():
    specs = sk.plan_requests(config(disconnect_fraction=0.1, timeout_fraction=0.1, stream_fraction=0.5,
                                    chat_fraction=0.5, multi_fraction=0.2, logprobs_fraction=0.25, n=3))
    actions = [s.action for s in specs]
    assert (actions.count(sk.NORMAL), actions.count(sk.DISCONNECT), actions.count(sk.TIMEOUT)) == (240, 30, 30)
    assert sum(s.stream for s in specs) == 30 + 135  # every disconnect streams, half of the others
    assert sum(s.api == "chat" for s in specs) == 150
    assert sum(s.n == 3 for s in specs) == 60 and {s.n for s in specs} == {1, 3}
    assert sum(s.logprobs for s in specs) == 75
    for s in specs:
        if s.action == sk.DISCONNECT:
            assert s.stream and s.max_tokens == 128 and 1 <= s.cut_after_events <= 3
        else:
            assert s.max_tokens == 16 and s.cut_after_events == 0
        assert (0.01 <= s.timeout_s <= 0.1) if s.action == sk.TIMEOUT else s.timeout_s == 0
    assert sk.plan_requests(config()) == sk.plan_requests(config())
    assert sk.plan_requests(config()) != sk.plan_requests(config(seed=1))


def test_request_bodies():
    spec = sk.RequestSpec(index=0, api="chat", stream=True, n=2, logprobs=True, action=sk.NORMAL, max_tokens=8,
                          seed=5, prompt="hi there")
    path, body = sk.request_body(spec, config(temperature=0.5))
    assert path == "/v1/chat/completions"
    assert body == {"model": "m", "max_tokens": 8, "n": 2, "temperature": 0.5, "seed": 5, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}, "logprobs": True,
                    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]}
    spec = sk.RequestSpec(index=0, api="completions", stream=False, n=1, logprobs=True, action=sk.NORMAL,
                          max_tokens=4, prompt="x")
    path, body = sk.request_body(spec, config(ignore_eos=False))
    assert path == "/v1/completions"
    assert body["prompt"] == "x" and body["logprobs"] == 1 and "ignore_eos" not in body and "stream" not in body


# ---- the usage check ----


def usage(completion: int, prompt: int = 5) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def tallies(*finishes, tokens=0):
    return {i: sk.ChoiceTally(finish_reason=f, tokens=tokens) for i, f in enumerate(finishes)}


def test_usage_agrees_with_length_choices_and_n_counts_every_choice():
    check = dict(max_tokens=8, counted=False, ignore_eos=True)
    assert sk.check_usage(usage(8), tallies("length"), n=1, **check) is None
    assert sk.check_usage(usage(24), tallies("length", "length", "length"), n=3, **check) is None
    assert sk.check_usage(usage(8), tallies("length", "length", "length"), n=3, **check) == \
        "completion_tokens 8, returned 24"
    assert sk.check_usage(usage(7), tallies("length"), n=1, **check) == "completion_tokens 7, returned 8"


def test_usage_problems_are_named():
    check = dict(max_tokens=8, counted=False, ignore_eos=True)
    assert sk.check_usage(None, tallies("length"), n=1, **check) == "no usage"
    assert sk.check_usage(usage(8), tallies("length"), n=2, **check) == "choices [0], expected 2"
    assert sk.check_usage(usage(8), tallies(None), n=1, **check) == "choice 0 has no finish_reason"
    assert sk.check_usage(usage(3), tallies("stop"), n=1, **check) == \
        "choice 0 ended with 'stop' despite ignore_eos"
    assert sk.check_usage({**usage(8), "total_tokens": 12}, tallies("length"), n=1, **check) == "total_tokens 12 != 5 + 8"
    assert sk.check_usage({"prompt_tokens": 5}, tallies("length"), n=1, **check).startswith("usage without token counts")


def test_counted_tokens_must_match_usage_and_max_tokens():
    check = dict(max_tokens=8, ignore_eos=True, counted=True)
    assert sk.check_usage(usage(16), tallies("length", "length", tokens=8), n=2, **check) is None
    assert sk.check_usage(usage(14), tallies("length", "length", tokens=7), n=2, **check) == \
        "choice 0 returned 7 tokens with finish_reason 'length', max_tokens 8"
    # without ignore_eos, a choice that stopped early is known exactly when its tokens were counted
    assert sk.check_usage(usage(11), {0: sk.ChoiceTally("length", 8), 1: sk.ChoiceTally("stop", 3)}, n=2,
                          max_tokens=8, counted=True, ignore_eos=False) is None


def test_without_ignore_eos_uncounted_stops_are_only_bounded():
    check = dict(max_tokens=8, counted=False, ignore_eos=False)
    assert sk.check_usage(usage(11), tallies("length", "stop"), n=2, **check) is None
    assert sk.check_usage(usage(17), tallies("length", "stop"), n=2, **check) == "completion_tokens 17 outside [8, 16]"


def test_stream_chunks_are_tallied_per_choice():
    chunks = [
        [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        [{"index": 1, "delta": {"content": "a"}, "logprobs": {"content": [{}, {}]}, "finish_reason": None}],
        [{"index": 0, "delta": {"content": "b"}, "logprobs": {"content": [{}]}, "finish_reason": "length"},
         {"index": 1, "delta": {}, "logprobs": None, "finish_reason": "length"}],
    ]
    out: dict = {}
    for choices in chunks:
        sk.tally_choices(choices, chat=True, tallies=out)
    assert out == {0: sk.ChoiceTally("length", 1), 1: sk.ChoiceTally("length", 2)}
    assert sk.tally_choices([{"index": 0, "text": "ab", "logprobs": {"tokens": ["a", "b"]}, "finish_reason": "stop"}],
                            chat=False) == {0: sk.ChoiceTally("stop", 2)}


# ---- /metrics ----


def server_metrics_text(running=0, waiting=0, free_pages=10, rss=None) -> str:
    """The exposition jax-serve's ingress renders (serve_app.replicas.metrics), two replicas of model m."""
    from engine.stats import EngineStats
    from serve_app.http.metrics import render
    from serve_app.replicas.metrics import ServerMetrics

    families = []
    for replica in ("r1", "r2"):
        stats = EngineStats(num_running=running, num_waiting=waiting, num_free_pages=free_pages, num_pages=10)
        metrics = ServerMetrics("m", replica, lambda stats=stats: stats, {"attention_backend": "cpu"})
        metrics.count_finished("length")
        families.append(metrics.families())
    text = render(families).decode()
    if rss is not None:
        text += f"# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes {rss}\n"
    return text


def test_idle_gauges_of_every_replica():
    samples = sk.parse_metrics(server_metrics_text())
    gauges = sk.idle_gauges(samples)
    assert gauges == {f"m/{r}": dict.fromkeys(sk.IDLE_GAUGES, 0.0) for r in ("r1", "r2")}
    assert sk.busy_series(gauges) == []
    assert sk.idle_gauges(samples, models=["other"]) == {}
    busy = sk.busy_series(sk.idle_gauges(sk.parse_metrics(server_metrics_text(running=1, free_pages=5))))
    assert busy == ["m/r1 vllm:kv_cache_usage_perc=0.5", "m/r1 vllm:num_requests_running=1",
                    "m/r2 vllm:kv_cache_usage_perc=0.5", "m/r2 vllm:num_requests_running=1"]
    assert sk.finished_by_reason(samples, "m") == {"length": 2.0}


def test_resident_memory_only_when_exported():
    assert sk.resident_memory(sk.parse_metrics(server_metrics_text())) == {}  # jax-serve exports none today
    assert sk.resident_memory(sk.parse_metrics(server_metrics_text(rss=1.5e9))) == {"server": 1.5e9}


def test_percentile_is_nearest_rank():
    assert sk.percentile([], 50) is None
    assert sk.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert sk.percentile(list(range(1, 101)), 99) == 99
    assert sk.percentile([5.0], 99) == 5.0


# ---- the report ----


def result(outcome, index=0, **kw) -> sk.RequestResult:
    return sk.RequestResult(index=index, kind="completions", action=sk.NORMAL, n=1, outcome=outcome, **kw)


def test_expected_outcomes_pass_and_anything_lost_fails():
    fine = [result(sk.OK, 0, latency_s=1.0), result(sk.DISCONNECTED, 1), result(sk.TIMED_OUT, 2),
            result(sk.REJECTED, 3)]
    report = sk.SoakReport(config=vars(config()), results=fine, idle=True)
    assert (report.failures, report.exit_code) == ([], 0)
    assert report.outcomes == {sk.DISCONNECTED: 1, sk.OK: 1, sk.REJECTED: 1, sk.TIMED_OUT: 1}
    assert report.latency(50) == report.latency(99) == 1.0
    assert sk.SoakReport(config=vars(config()), results=fine, idle=None).exit_code == 0  # unknown is not lost
    not_idle = sk.SoakReport(config=vars(config()), results=fine, idle=False, busy=["m/r1 vllm:num_requests_running=1"])
    assert (not_idle.failures, not_idle.exit_code) == (["server not idle: m/r1 vllm:num_requests_running=1"], 1)
    for outcome in (sk.HTTP_5XX, sk.HTTP_4XX, sk.MISSING_DONE, sk.STREAM_ERROR, sk.USAGE_MISMATCH, sk.BAD_RESPONSE,
                    sk.TRANSPORT_ERROR):
        report = sk.SoakReport(config=vars(config()), results=[*fine, result(outcome, 9, detail="why")], idle=True)
        assert report.failures == [f"1 {outcome} (e.g. request 9, completions: why)"] and report.exit_code == 1
        assert "result: FAILED: 1 " + outcome in sk.format_report(report)


# ---- whole runs against an in-memory fake server ----


class FakeServer:
    """An OpenAI-shaped server in memory: exact answers (ignore_eos: max_tokens per choice), a 429
    (Retry-After 0) for every third POST, 10 ms per answer. `fault` breaks every tenth answer
    ("500", "short": usage one token short), every stream ("no_done") or the idle check."""

    def __init__(self, fault: str = ""):
        self.fault = fault
        self.posts = 0
        self.scrapes = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            self.scrapes += 1
            busy = self.fault == "never_idle" or self.scrapes == 2  # busy once, just after the run
            return httpx.Response(200, text=server_metrics_text(running=int(busy), rss=1e9 + self.scrapes))
        assert request.headers["authorization"] == "Bearer k"
        body = json.loads(request.content)
        self.posts += 1
        if self.posts % 3 == 0:
            return httpx.Response(429, headers={"retry-after": "0"}, json={"error": {"message": "busy"}})
        await asyncio.sleep(0.01)
        if self.fault == "500" and self.posts % 10 == 1:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        chat = request.url.path.endswith("/chat/completions")
        tokens = body["max_tokens"]
        short = self.fault == "short" and self.posts % 10 == 1
        if body.get("stream"):
            return httpx.Response(200, content=self.stream(body, chat, tokens, short),
                                  headers={"content-type": "text/event-stream"})
        choices = [self.choice(i, chat, body, tokens, full=True) for i in range(body["n"])]
        return httpx.Response(200, json={"choices": choices, "usage": self.usage(body, short)})

    @staticmethod
    def usage(body, short=False):
        completion = body["n"] * body["max_tokens"] - short
        return {"prompt_tokens": 3, "completion_tokens": completion, "total_tokens": 3 + completion}

    @staticmethod
    def choice(index, chat, body, tokens, full, last=True):
        logprobs = None
        if body.get("logprobs"):
            logprobs = {"content": [{}] * tokens} if chat else {"tokens": ["t"] * tokens}
        content = {"message": {"role": "assistant", "content": "t" * tokens}} if full and chat else \
            {"delta": {"content": "t" * tokens}} if chat else {"text": "t" * tokens}
        return {"index": index, **content, "logprobs": logprobs, "finish_reason": "length" if last else None}

    async def stream(self, body, chat, tokens, short):
        for step in range(tokens):
            choices = [self.choice(i, chat, body, 1, full=False, last=step == tokens - 1) for i in range(body["n"])]
            yield f"data: {json.dumps({'choices': choices})}\n\n".encode()
            await asyncio.sleep(0)
        yield f"data: {json.dumps({'choices': [], 'usage': self.usage(body, short)})}\n\n".encode()
        if self.fault != "no_done":
            yield b"data: [DONE]\n\n"


def run(server: FakeServer, **overrides) -> sk.SoakReport:
    settings = dict(requests=60, concurrency=8, api_key="k", max_tokens=4, client_timeout_s=0.002,
                    idle_timeout_s=1.0, pids=[])
    return asyncio.run(sk.soak(config(**{**settings, **overrides}), transport=httpx.MockTransport(server)))


def test_a_run_against_a_correct_server_loses_nothing():
    server = FakeServer()
    report = run(server)
    assert report.actions == {sk.DISCONNECT: 6, sk.NORMAL: 48, sk.TIMEOUT: 6}
    assert report.outcomes_by_action() == {sk.DISCONNECT: {sk.DISCONNECTED: 6}, sk.NORMAL: {sk.OK: 48},
                                           sk.TIMEOUT: {sk.TIMED_OUT: 6}}
    assert report.retries_429 > 0 and report.multi_choice == 12
    assert (report.idle, report.busy, report.idle_series) == (True, [], ["m/r1", "m/r2"])
    assert report.memory_source == "/metrics process_resident_memory_bytes"
    assert report.memory_before == {"server": 1e9 + 1} and report.memory_after == {"server": 1e9 + 3}
    assert report.failures == [] and report.exit_code == 0
    text = sk.format_report(report)
    assert "outcomes: disconnected 6, ok 48, timed_out 6" in text and "result: OK" in text


def test_without_retries_429s_are_counted_not_failed():
    report = run(FakeServer(), retry_429=False, timeout_fraction=0)
    assert report.outcomes[sk.REJECTED] > 0 and report.retries_429 == 0
    assert sum(report.outcomes.values()) == 60 and report.exit_code == 0


@pytest.mark.parametrize("fault,outcome", [("500", sk.HTTP_5XX), ("short", sk.USAGE_MISMATCH),
                                           ("no_done", sk.MISSING_DONE)])
def test_a_faulty_server_fails_the_run(fault, outcome):
    report = run(FakeServer(fault), disconnect_fraction=0, timeout_fraction=0)
    assert report.outcomes.get(outcome, 0) > 0 and report.exit_code == 1
    assert any(f.split(" ")[1] == outcome for f in report.failures)


def test_a_server_that_never_gets_idle_fails_the_run():
    report = run(FakeServer("never_idle"), requests=10, idle_timeout_s=0.3)
    assert report.idle is False and report.busy and report.exit_code == 1
    assert report.failures[-1].startswith("server not idle: m/r1 vllm:num_requests_running=1")


def test_memory_from_local_pids_when_metrics_has_none():
    import os

    class NoRss(FakeServer):
        async def __call__(self, request):
            response = await super().__call__(request)
            if request.url.path == "/metrics":
                return httpx.Response(200, text=server_metrics_text(running=int(self.scrapes == 2)))
            return response

    report = run(NoRss(), requests=6, pids=[os.getpid()])
    assert report.memory_source.startswith("RSS of the given server processes")
    assert set(report.memory_before) == set(report.memory_after) == {f"pid {os.getpid()}"}
    assert run(NoRss(), requests=6).memory_source.startswith("unavailable")
