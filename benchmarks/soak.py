"""Soak test for any OpenAI-compatible endpoint: many mixed requests, then check nothing was lost.

    python -m benchmarks.soak --base-url http://127.0.0.1:8000 --model smollm2-135m-instruct \
        --requests 2000 --concurrency 64 --disconnect-fraction 0.1 --timeout-fraction 0.1

It sends `--requests` requests, at most `--concurrency` in flight, mixing completions and chat
completions (`--chat-fraction`), streamed and not (`--stream-fraction`), `n` > 1
(`--multi-fraction` of them ask for `--n` choices), token logprobs (`--logprobs-fraction`: the
tokens returned can then be counted exactly), clients that disconnect mid-stream
(`--disconnect-fraction`: a stream of `--disconnect-max-tokens` closed after reading 1 to 3
events) and clients that give up (`--timeout-fraction`: the whole request is cancelled after a
tiny timeout, at most `--client-timeout-s`). The plan is drawn from `--seed` and the counts of each kind are exact
(rounded fractions of `--requests`). Every request asks for `ignore_eos` and `max_tokens`, so each
choice must end with finish_reason "length" after exactly `max_tokens` tokens.

Outcomes: `ok` (a valid answer), `disconnected` / `timed_out` (cut by the client, as planned),
`rejected_429` (backpressure: retried after Retry-After unless `--no-retry-429`; counted, not a
failure), and failures: `http_5xx`, `http_4xx`, `missing_done` (a stream the client did not cut
that ended without `data: [DONE]`), `stream_error` (an error event mid-stream), `usage_mismatch`
(`usage.completion_tokens` differs from the tokens returned, or from n x max_tokens when every choice
ended with "length"; wrong choice counts; no usage chunk on a stream that asked for one),
`bad_response`, `transport_error`.

Afterwards it polls the server's Prometheus `/metrics` (up to `--idle-timeout-s`) until
`vllm:num_requests_running`, `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` are 0 for
every (model_name, replica) series (`--idle-model` restricts the check), and reports each replica's
resident memory before and after: `process_resident_memory_bytes` when /metrics has it, else the
RSS of `--pid` processes (a server on this machine), else "unavailable".

Exit code 1 when anything was lost (a failure outcome, or the server not back to idle), else 0.
The core is `await soak(SoakConfig(...)) -> SoakReport`, usable in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import httpx

OK, DISCONNECTED, TIMED_OUT, REJECTED = "ok", "disconnected", "timed_out", "rejected_429"
HTTP_5XX, HTTP_4XX, MISSING_DONE, STREAM_ERROR = "http_5xx", "http_4xx", "missing_done", "stream_error"
USAGE_MISMATCH, BAD_RESPONSE, TRANSPORT_ERROR = "usage_mismatch", "bad_response", "transport_error"
EXPECTED_OUTCOMES = (OK, DISCONNECTED, TIMED_OUT, REJECTED)
"""Outcomes that lose nothing: everything else is a failure."""

NORMAL, DISCONNECT, TIMEOUT = "normal", "disconnect", "timeout"
IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
RSS_METRIC = "process_resident_memory_bytes"
WORDS = ("the quick brown fox jumps over a lazy dog while seven old wizards quietly brew strong coffee "
         "under bright autumn stars near the river bank and every small bird sings").split()


# ---------------------------------------------------------------------------------------------
# Configuration, plan and records
# ---------------------------------------------------------------------------------------------


@dataclass
class SoakConfig:
    base_url: str
    model: str
    requests: int = 200
    concurrency: int = 16
    api_key: Optional[str] = None
    max_tokens: int = 16
    disconnect_max_tokens: Optional[int] = None
    """max_tokens of the streams the client cuts (default: 4 x max_tokens, at least 128, so that the
    cut comes mid-generation and the server has to abort the request)."""
    disconnect_fraction: float = 0.1
    timeout_fraction: float = 0.1
    stream_fraction: float = 0.5
    """Of the requests that are not disconnects (those always stream)."""
    chat_fraction: float = 0.5
    multi_fraction: float = 0.2
    n: int = 3
    logprobs_fraction: float = 0.25
    client_timeout_s: float = 0.1
    """The tiny client timeouts are drawn from [client_timeout_s / 10, client_timeout_s]."""
    request_timeout_s: float = 300.0
    """Any other request slower than this is a transport_error."""
    retry_429: bool = True
    max_429_retries: int = 100
    max_retry_after_s: float = 10.0
    ignore_eos: bool = True
    temperature: float = 0.8
    idle_timeout_s: float = 60.0
    idle_models: Optional[list[str]] = None
    """Models whose gauges must return to 0 (None: every model on the server)."""
    pids: list[int] = field(default_factory=list)
    """Server processes on this machine whose RSS to report when /metrics has no RSS metric."""
    seed: int = 0


@dataclass
class RequestSpec:
    index: int
    api: str  # "completions" or "chat"
    stream: bool
    n: int
    logprobs: bool
    action: str  # NORMAL, DISCONNECT, TIMEOUT
    max_tokens: int
    cut_after_events: int = 0
    timeout_s: float = 0.0
    seed: int = 0
    prompt: str = ""

    @property
    def kind(self) -> str:
        return self.api + ("-stream" if self.stream else "")


@dataclass
class RequestResult:
    index: int
    kind: str
    action: str
    n: int
    outcome: str
    status: Optional[int] = None
    latency_s: Optional[float] = None
    """Of the last attempt (after any 429 retries)."""
    ttft_s: Optional[float] = None
    retries_429: int = 0
    detail: str = ""


def _exact(count: int, fraction: float) -> int:
    return max(0, min(count, round(count * fraction)))


def plan_requests(config: SoakConfig) -> list[RequestSpec]:
    """The requests of a run, drawn from `config.seed`; each kind's count is an exact rounded fraction."""
    rng = random.Random(config.seed)
    total = config.requests

    def chosen(count: int, among: Sequence[int]) -> set[int]:
        return set(rng.sample(list(among), count))

    order = list(range(total))
    rng.shuffle(order)
    disconnects = set(order[: _exact(total, config.disconnect_fraction)])
    timeouts = set(order[len(disconnects) : len(disconnects) + _exact(total, config.timeout_fraction)])
    others = [i for i in range(total) if i not in disconnects]
    streamed = disconnects | chosen(_exact(len(others), config.stream_fraction), others)
    chat = chosen(_exact(total, config.chat_fraction), range(total))
    multi = chosen(_exact(total, config.multi_fraction), range(total)) if config.n > 1 else set()
    logprobs = chosen(_exact(total, config.logprobs_fraction), range(total))
    long_tokens = config.disconnect_max_tokens or max(4 * config.max_tokens, 128)
    specs = []
    for i in range(total):
        action = DISCONNECT if i in disconnects else TIMEOUT if i in timeouts else NORMAL
        words = rng.randint(3, 40)
        specs.append(RequestSpec(
            index=i, api="chat" if i in chat else "completions", stream=i in streamed,
            n=config.n if i in multi else 1, logprobs=i in logprobs, action=action,
            max_tokens=long_tokens if action == DISCONNECT else config.max_tokens,
            cut_after_events=rng.randint(1, 3) if action == DISCONNECT else 0,
            timeout_s=rng.uniform(config.client_timeout_s / 10, config.client_timeout_s) if action == TIMEOUT else 0.0,
            seed=rng.randrange(2**31), prompt=" ".join(rng.choice(WORDS) for _ in range(words)),
        ))
    return specs


def request_body(spec: RequestSpec, config: SoakConfig) -> tuple[str, dict]:
    """(path, JSON body) of one request."""
    body: dict[str, Any] = {"model": config.model, "max_tokens": spec.max_tokens, "n": spec.n,
                            "temperature": config.temperature, "seed": spec.seed}
    if config.ignore_eos:
        body["ignore_eos"] = True
    if spec.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if spec.api == "chat":
        body["messages"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": spec.prompt}]
        if spec.logprobs:
            body["logprobs"] = True
        return "/v1/chat/completions", body
    body["prompt"] = spec.prompt
    if spec.logprobs:
        body["logprobs"] = 1
    return "/v1/completions", body


# ---------------------------------------------------------------------------------------------
# Pure checks: choices and usage, metrics
# ---------------------------------------------------------------------------------------------


@dataclass
class ChoiceTally:
    finish_reason: Optional[str] = None
    tokens: int = 0
    """Tokens counted from the logprobs (meaningful when the request asked for logprobs)."""


def count_logprob_tokens(choice: dict, chat: bool) -> int:
    logprobs = choice.get("logprobs")
    if not logprobs:
        return 0
    return len(logprobs.get("content") or []) if chat else len(logprobs.get("tokens") or [])


def tally_choices(choices: list[dict], chat: bool,
                  tallies: Optional[dict[int, ChoiceTally]] = None) -> dict[int, ChoiceTally]:
    """Adds `choices` (of a response, or of one stream chunk) to the per-index tallies."""
    tallies = {} if tallies is None else tallies
    for choice in choices:
        tally = tallies.setdefault(int(choice.get("index", 0)), ChoiceTally())
        tally.tokens += count_logprob_tokens(choice, chat)
        if choice.get("finish_reason") is not None:
            tally.finish_reason = choice["finish_reason"]
    return tallies


def check_usage(usage: Optional[dict], tallies: dict[int, ChoiceTally], *, n: int, max_tokens: int,
                counted: bool, ignore_eos: bool) -> Optional[str]:
    """None when `usage` agrees with the choices, else what is wrong. Each choice's tokens are known
    exactly when they were `counted` (logprobs), or are `max_tokens` when it ended with "length";
    with ignore_eos every choice must end with "length". n > 1: usage counts every choice."""
    if sorted(tallies) != list(range(n)):
        return f"choices {sorted(tallies)}, expected {n}"
    if usage is None:
        return "no usage"
    completion, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
    if not isinstance(completion, int) or not isinstance(prompt, int):
        return f"usage without token counts: {usage}"
    if usage.get("total_tokens") is not None and usage["total_tokens"] != prompt + completion:
        return f"total_tokens {usage['total_tokens']} != {prompt} + {completion}"
    known, unknown = 0, 0
    for index, tally in sorted(tallies.items()):
        if tally.finish_reason is None:
            return f"choice {index} has no finish_reason"
        if ignore_eos and tally.finish_reason != "length":
            return f"choice {index} ended with {tally.finish_reason!r} despite ignore_eos"
        if counted:
            if tally.finish_reason == "length" and tally.tokens != max_tokens:
                return (f"choice {index} returned {tally.tokens} tokens with finish_reason 'length', "
                        f"max_tokens {max_tokens}")
            known += tally.tokens
        elif tally.finish_reason == "length":
            known += max_tokens
        else:
            unknown += 1
    if unknown == 0 and completion != known:
        return f"completion_tokens {completion}, returned {known}"
    if unknown and not known <= completion <= known + unknown * max_tokens:
        return f"completion_tokens {completion} outside [{known}, {known + unknown * max_tokens}]"
    return None


def parse_metrics(text: str) -> list:
    """Every sample of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def _series(labels: dict) -> str:
    return f"{labels.get('model_name', '?')}/{labels.get('replica', '?')}"


def idle_gauges(samples: list, models: Optional[Sequence[str]] = None) -> dict[str, dict[str, float]]:
    """{'model/replica': {gauge: value}} of the idle gauges, for `models` (None: all)."""
    out: dict[str, dict[str, float]] = {}
    for sample in samples:
        if sample.name in IDLE_GAUGES and (models is None or sample.labels.get("model_name") in models):
            out.setdefault(_series(sample.labels), {})[sample.name] = sample.value
    return out


def busy_series(gauges: dict[str, dict[str, float]]) -> list[str]:
    """'model/replica gauge=value' for every idle gauge that is not 0."""
    return [f"{series} {name}={value:g}" for series, values in sorted(gauges.items())
            for name, value in sorted(values.items()) if value != 0]


def resident_memory(samples: list) -> dict[str, float]:
    """`process_resident_memory_bytes` per series (empty when the server does not export it)."""
    return {_series(s.labels) if s.labels else "server": s.value for s in samples if s.name == RSS_METRIC}


def finished_by_reason(samples: list, model: str) -> dict[str, float]:
    """`vllm:request_success_total` of `model` summed over replicas, by finished_reason."""
    out: Counter = Counter()
    for s in samples:
        if s.name == "vllm:request_success_total" and s.labels.get("model_name") == model:
            out[s.labels.get("finished_reason", "?")] += s.value
    return dict(out)


def percentile(values: Sequence[float], p: float) -> Optional[float]:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------


@dataclass
class SoakReport:
    config: dict
    results: list[RequestResult]
    duration_s: float = 0.0
    idle: Optional[bool] = None
    """True: every idle gauge back to 0; False: not within idle_timeout_s; None: no gauges to read."""
    idle_wait_s: float = 0.0
    idle_series: list[str] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)
    memory_source: str = "unavailable"
    memory_before: dict[str, float] = field(default_factory=dict)
    memory_after: dict[str, float] = field(default_factory=dict)
    server_finished: dict[str, float] = field(default_factory=dict)
    """Delta of the model's vllm:request_success_total over the run, by finished_reason."""
    notes: list[str] = field(default_factory=list)

    @property
    def kinds(self) -> dict[str, int]:
        return dict(sorted(Counter(r.kind for r in self.results).items()))

    @property
    def actions(self) -> dict[str, int]:
        return dict(sorted(Counter(r.action for r in self.results).items()))

    @property
    def multi_choice(self) -> int:
        return sum(r.n > 1 for r in self.results)

    @property
    def outcomes(self) -> dict[str, int]:
        return dict(sorted(Counter(r.outcome for r in self.results).items()))

    def outcomes_by_action(self) -> dict[str, dict[str, int]]:
        out: dict[str, Counter] = {}
        for r in self.results:
            out.setdefault(r.action, Counter())[r.outcome] += 1
        return {action: dict(sorted(c.items())) for action, c in sorted(out.items())}

    @property
    def retries_429(self) -> int:
        return sum(r.retries_429 for r in self.results)

    def latency(self, p: float) -> Optional[float]:
        return percentile([r.latency_s for r in self.results if r.outcome == OK and r.latency_s is not None], p)

    def ttft(self, p: float) -> Optional[float]:
        return percentile([r.ttft_s for r in self.results if r.outcome == OK and r.ttft_s is not None], p)

    @property
    def failures(self) -> list[str]:
        """What was lost: failure outcomes (with an example each) and a server not back to idle."""
        out = []
        for outcome, count in self.outcomes.items():
            if outcome not in EXPECTED_OUTCOMES:
                example = next(r for r in self.results if r.outcome == outcome)
                out.append(f"{count} {outcome} (e.g. request {example.index}, {example.kind}: {example.detail})")
        if self.idle is False:
            out.append("server not idle: " + ", ".join(self.busy))
        return out

    @property
    def exit_code(self) -> int:
        return 1 if self.failures else 0

    def to_json(self) -> dict:
        return {**asdict(self), "kinds": self.kinds, "actions": self.actions, "outcomes": self.outcomes,
                "outcomes_by_action": self.outcomes_by_action(), "retries_429": self.retries_429,
                "latency_p50_s": self.latency(50), "latency_p99_s": self.latency(99),
                "ttft_p50_s": self.ttft(50), "ttft_p99_s": self.ttft(99), "failures": self.failures}


def _mib(value: float) -> str:
    return f"{value / 2**20:.1f} MiB"


def _seconds(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _counts(counts: dict) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in counts.items()) or "none"


def format_report(report: SoakReport) -> str:
    c = report.config
    lines = [
        f"soak: {len(report.results)} requests at concurrency {c['concurrency']} against {c['base_url']} "
        f"(model {c['model']}) in {report.duration_s:.1f} s",
        f"  kinds: {_counts(report.kinds)}; n={c['n']}: {report.multi_choice}",
        f"  actions: {_counts(report.actions)}",
        f"  outcomes: {_counts(report.outcomes)}; 429 retries: {report.retries_429}",
        f"  latency (ok): p50 {_seconds(report.latency(50))}, p99 {_seconds(report.latency(99))}; "
        f"first event (ok streams): p50 {_seconds(report.ttft(50))}, p99 {_seconds(report.ttft(99))}",
        f"  server finished (vllm:request_success_total delta): {_counts(report.server_finished)}",
    ]
    if report.idle is None:
        lines.append("  idle: unknown (no vllm:num_requests_running / _waiting / kv_cache_usage_perc in /metrics)")
    elif report.idle:
        lines.append(f"  idle: yes after {report.idle_wait_s:.1f} s ({len(report.idle_series)} series: "
                     "running, waiting, KV usage all 0)")
    else:
        lines.append(f"  idle: NO after {report.idle_wait_s:.1f} s: " + ", ".join(report.busy))
    if report.memory_before or report.memory_after:
        lines.append(f"  memory ({report.memory_source}):")
        for key in sorted(set(report.memory_before) | set(report.memory_after)):
            before, after = report.memory_before.get(key), report.memory_after.get(key)
            delta = ""
            if before is not None and after is not None:
                delta = f" ({'+' if after >= before else '-'}{_mib(abs(after - before))})"
            lines.append(f"    {key}: {'-' if before is None else _mib(before)} before, "
                         f"{'-' if after is None else _mib(after)} after{delta}")
    else:
        lines.append(f"  memory: {report.memory_source}")
    lines += [f"  note: {note}" for note in report.notes]
    failures = report.failures
    lines.append("  result: OK" if not failures else "  result: FAILED: " + "; ".join(failures))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Driving the requests
# ---------------------------------------------------------------------------------------------


def _snippet(text: str) -> str:
    return " ".join(text.split())[:200]


def _classify_status(status: int, text: str) -> tuple[str, str]:
    return (HTTP_5XX if status >= 500 else HTTP_4XX), f"HTTP {status}: {_snippet(text)}"


def _retry_after(response: httpx.Response, config: SoakConfig, rng: random.Random) -> float:
    try:
        seconds = float(response.headers.get("retry-after", "1"))
    except ValueError:
        seconds = 1.0
    return min(max(seconds, 0.05), config.max_retry_after_s) * (1 + rng.random() / 2)


async def _attempt(client: httpx.AsyncClient, spec: RequestSpec, config: SoakConfig,
                   result: RequestResult) -> Optional[httpx.Response]:
    """One try; fills `result`, or returns the 429 response to retry."""
    path, body = request_body(spec, config)
    chat = spec.api == "chat"
    started = time.perf_counter()
    if not spec.stream:
        response = await client.post(path, json=body)
        result.status = response.status_code
        if response.status_code == 429:
            return response
        result.latency_s = time.perf_counter() - started
        if response.status_code != 200:
            result.outcome, result.detail = _classify_status(response.status_code, response.text)
            return None
        try:
            payload = response.json()
            tallies = tally_choices(payload["choices"], chat)
        except (ValueError, KeyError, TypeError) as exc:
            result.outcome, result.detail = BAD_RESPONSE, f"{exc!r}: {_snippet(response.text)}"
            return None
        problem = check_usage(payload.get("usage"), tallies, n=spec.n, max_tokens=spec.max_tokens,
                              counted=spec.logprobs, ignore_eos=config.ignore_eos)
        result.outcome, result.detail = (USAGE_MISMATCH, problem) if problem else (OK, "")
        return None

    async with client.stream("POST", path, json=body) as response:
        result.status = response.status_code
        if response.status_code == 429:
            await response.aread()
            return response
        if response.status_code != 200:
            await response.aread()
            result.outcome, result.detail = _classify_status(response.status_code, response.text)
            result.latency_s = time.perf_counter() - started
            return None
        tallies: dict[int, ChoiceTally] = {}
        usage, events, done, error = None, 0, False, None
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                events += 1
                if result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - started
                event = json.loads(data)
                if "error" in event and error is None:
                    error = event["error"]
                tally_choices(event.get("choices") or [], chat, tallies)
                if event.get("usage"):
                    usage = event["usage"]
                if spec.action == DISCONNECT and events >= spec.cut_after_events:
                    result.outcome, result.detail = DISCONNECTED, f"closed after {events} events"
                    return None  # leaving the block closes the connection mid-stream
        except httpx.HTTPError as exc:  # the server closed the stream: [DONE] never came
            result.detail = repr(exc)
        except ValueError as exc:
            result.outcome, result.detail = BAD_RESPONSE, f"unparsable event: {exc!r}"
            return None
        result.latency_s = time.perf_counter() - started
        if error is not None:
            result.outcome, result.detail = STREAM_ERROR, _snippet(json.dumps(error))
        elif not done:
            result.outcome, result.detail = MISSING_DONE, f"after {events} events {result.detail}".strip()
        else:
            problem = check_usage(usage, tallies, n=spec.n, max_tokens=spec.max_tokens,
                                  counted=spec.logprobs, ignore_eos=config.ignore_eos)
            result.outcome, result.detail = (USAGE_MISMATCH, problem) if problem else (OK, "")
        return None


async def run_request(client: httpx.AsyncClient, spec: RequestSpec, config: SoakConfig) -> RequestResult:
    """One planned request, through any 429 retries, under its tiny deadline when it has one."""
    result = RequestResult(index=spec.index, kind=spec.kind, action=spec.action, n=spec.n, outcome=BAD_RESPONSE)
    rng = random.Random(spec.seed)

    async def attempts() -> None:
        while True:
            rejected = await _attempt(client, spec, config, result)
            if rejected is None:
                return
            if not config.retry_429 or result.retries_429 >= config.max_429_retries:
                result.outcome, result.detail = REJECTED, f"after {result.retries_429} retries"
                return
            result.retries_429 += 1
            await asyncio.sleep(_retry_after(rejected, config, rng))

    try:
        if spec.action == TIMEOUT:
            async with asyncio.timeout(spec.timeout_s):  # cancels the request: the connection is dropped
                await attempts()
        else:
            await attempts()
    except TimeoutError:
        result.outcome, result.detail = TIMED_OUT, f"client timeout {spec.timeout_s:.3f} s"
    except httpx.HTTPError as exc:
        result.outcome = MISSING_DONE if spec.stream and result.status == 200 else TRANSPORT_ERROR
        result.detail = repr(exc)
    except Exception as exc:  # anything else unexpected: counted, the soak goes on
        result.outcome, result.detail = BAD_RESPONSE, repr(exc)
    return result


async def _scrape(client: httpx.AsyncClient) -> Optional[list]:
    try:
        response = await client.get("/metrics", timeout=30)
        return parse_metrics(response.text) if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _pid_memory(pids: Sequence[int]) -> dict[str, float]:
    import psutil

    out = {}
    for pid in pids:
        try:
            out[f"pid {pid}"] = float(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            pass
    return out


def _memory(samples: Optional[list], config: SoakConfig) -> tuple[str, dict[str, float]]:
    from_metrics = resident_memory(samples or [])
    if from_metrics:
        return f"/metrics {RSS_METRIC}", from_metrics
    if config.pids:
        return "RSS of the given server processes (psutil); /metrics has no " + RSS_METRIC, _pid_memory(config.pids)
    return f"unavailable (/metrics has no {RSS_METRIC}; pass --pid for a local server)", {}


async def wait_idle(client: httpx.AsyncClient,
                    config: SoakConfig) -> tuple[Optional[bool], float, list[str], list[str], Optional[list]]:
    """Poll /metrics until every idle gauge is 0: (idle, waited s, series, busy, last samples)."""
    started = time.monotonic()
    samples, gauges = None, {}
    while True:
        samples = await _scrape(client)
        gauges = idle_gauges(samples or [], config.idle_models)
        busy = busy_series(gauges)
        waited = time.monotonic() - started
        if gauges and not busy:
            return True, waited, sorted(gauges), [], samples
        if waited >= config.idle_timeout_s:
            return (False if gauges else None), waited, sorted(gauges), busy, samples
        await asyncio.sleep(0.25)


async def soak(config: SoakConfig, transport: Optional[httpx.AsyncBaseTransport] = None) -> SoakReport:
    """Runs the whole soak: the planned requests, then the idle check and memory. (`transport`: an
    httpx transport in place of the network, for tests.)"""
    specs = plan_requests(config)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.concurrency + 4, max_keepalive_connections=config.concurrency + 4)
    report = SoakReport(config=asdict(config), results=[])
    async with httpx.AsyncClient(base_url=config.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(config.request_timeout_s), transport=transport) as client:
        before = await _scrape(client)
        if before is None:
            report.notes.append("could not read /metrics before the run")
        memory_source, report.memory_before = _memory(before, config)
        pending = iter(specs)
        results: list[RequestResult] = []

        async def worker() -> None:
            for spec in pending:
                results.append(await run_request(client, spec, config))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(max(1, config.concurrency))))
        report.duration_s = time.perf_counter() - started
        report.results = sorted(results, key=lambda r: r.index)
        report.idle, report.idle_wait_s, report.idle_series, report.busy, after = await wait_idle(client, config)
        report.memory_source, report.memory_after = _memory(after, config)
        if report.memory_source != memory_source:
            report.notes.append(f"memory before from {memory_source}")
        if before is not None and after is not None:
            start, end = finished_by_reason(before, config.model), finished_by_reason(after, config.model)
            report.server_finished = {k: end.get(k, 0) - start.get(k, 0) for k in sorted(set(start) | set(end))
                                      if end.get(k, 0) != start.get(k, 0)}
    return report


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SoakConfig(base_url="", model="")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--disconnect-max-tokens", type=int, default=None, help="default: 4 x --max-tokens, at least 128")
    p.add_argument("--disconnect-fraction", type=float, default=d.disconnect_fraction)
    p.add_argument("--timeout-fraction", type=float, default=d.timeout_fraction)
    p.add_argument("--client-timeout-s", type=float, default=d.client_timeout_s)
    p.add_argument("--stream-fraction", type=float, default=d.stream_fraction)
    p.add_argument("--chat-fraction", type=float, default=d.chat_fraction)
    p.add_argument("--multi-fraction", type=float, default=d.multi_fraction, help="requests that ask for --n choices")
    p.add_argument("--n", type=int, default=d.n)
    p.add_argument("--logprobs-fraction", type=float, default=d.logprobs_fraction)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="for servers without ignore_eos: token counts are then only bounded")
    p.add_argument("--no-retry-429", dest="retry_429", action="store_false",
                   help="count 429s as rejected instead of retrying after Retry-After")
    p.add_argument("--max-429-retries", type=int, default=d.max_429_retries)
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    p.add_argument("--idle-timeout-s", type=float, default=d.idle_timeout_s)
    p.add_argument("--idle-model", dest="idle_models", action="append", default=None,
                   help="check only this model's gauges (repeatable; default: every model)")
    p.add_argument("--pid", dest="pids", type=int, action="append", default=[],
                   help="a local server process whose RSS to report (repeatable)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--output-json", default=None, help="write the report, every request included")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = vars(build_parser().parse_args(argv))
    output = args.pop("output_json")
    report = asyncio.run(soak(SoakConfig(**args)))
    print(format_report(report))
    if output:
        with open(output, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
