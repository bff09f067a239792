"""Serving benchmark for any OpenAI-compatible endpoint (in the spirit of `vllm bench serve`).

    python -m benchmarks.serve_bench --base-url http://127.0.0.1:8000 --model bench-llama --vocab-size 32000
    python -m benchmarks.serve_bench --base-url http://127.0.0.1:8080 --model m --tokenizer /ckpt --prompt-type text
    python -m benchmarks.serve_bench --base-url ... --model m --dataset-path prompts.jsonl --request-rate 2 --max-concurrency 0

Each level of the sweep (every `--max-concurrency` x `--request-rate` pair) sends `--num-prompts`
streamed requests (temperature 0, `ignore_eos` + `max_tokens` so each produces exactly
`--output-len` tokens), at most `concurrency` in flight, arrivals spaced as a Poisson process of
`rate` requests/s (`inf`: all at once). Prompts are random token ids (`--prompt-type ids`, which
jax-serve, vLLM and llama-server accept), text that tokenizes to exactly `--input-len` tokens
with `--tokenizer` (`--prompt-type text`), or the `prompt` (and optional `max_tokens`) of each
line of a JSONL file. Each level gets its own random prompts, so prefix caches do not carry over.

Per level: completed / failed requests, request, output and total token throughput, and TTFT,
TPOT, ITL and end-to-end latency (mean, median, p95, p99, in ms). Output tokens are taken from the
final usage chunk (`stream_options.include_usage`) or, when a server sends none, from the number
of content chunks; requests whose count differs from what was asked are reported as mismatches.
TPOT is (latency - TTFT) / (output tokens - 1) per request; ITL is the gap between consecutive
content chunks, so a server that sends several tokens per chunk shows fewer, longer ITLs.

`--scrape-metrics` reads the server's Prometheus /metrics (vLLM's names: jax-serve and vLLM)
around each level and reports the server-side counterparts (see `server_side_summary`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import aiohttp
import numpy as np

logger = logging.getLogger("serve_bench")

PERCENTILES = (50, 95, 99)


# ---------------------------------------------------------------------------------------------
# Configuration and records
# ---------------------------------------------------------------------------------------------


@dataclass
class BenchConfig:
    """Everything that defines a run (stored in the JSON report)."""

    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    api_key: Optional[str] = None
    input_len: int = 128
    output_len: int = 128
    num_prompts: int = 64
    concurrencies: list[int] = field(default_factory=lambda: [1, 8, 32])
    """0 means unbounded (only the request rate limits arrivals)."""
    request_rates: list[float] = field(default_factory=lambda: [math.inf])
    prompt_type: str = "ids"
    """'ids' (token id lists) or 'text' (needs `tokenizer`)."""
    tokenizer: Optional[str] = None
    vocab_size: Optional[int] = None
    dataset_path: Optional[str] = None
    seed: int = 0
    warmup_requests: int = 2
    request_timeout_s: float = 600.0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    scrape_metrics: bool = False
    disable_tqdm: bool = False

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/" + self.endpoint.lstrip("/")

    @property
    def is_chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


@dataclass
class Prompt:
    """One request's prompt: token ids or text, its length in tokens, and its max_tokens."""

    prompt: Any
    prompt_len: int
    max_tokens: int


@dataclass
class RequestResult:
    """Raw timings of one request; times in seconds, `start` relative to the level's start."""

    index: int
    prompt_len: int
    expected_tokens: int
    start: float = 0.0
    success: bool = False
    error: Optional[str] = None
    ttft: Optional[float] = None
    latency: Optional[float] = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    usage_tokens: Optional[int] = None
    usage_prompt_tokens: Optional[int] = None
    finish_reason: Optional[str] = None

    @property
    def output_tokens(self) -> int:
        """Tokens generated: the server's usage when it sent one, else the content chunks."""
        return self.usage_tokens if self.usage_tokens is not None else self.chunks

    @property
    def tpot(self) -> Optional[float]:
        if self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


# ---------------------------------------------------------------------------------------------
# Pure helpers: statistics, SSE, chunk parsing
# ---------------------------------------------------------------------------------------------


def percentiles(values: Sequence[float], ps: Sequence[float] = PERCENTILES, scale: float = 1.0) -> dict:
    """mean and percentiles (`median` for 50, `p95`, ...) of `values` times `scale`; None when empty."""
    keys = ["mean"] + ["median" if p == 50 else f"p{p:g}" for p in ps]
    if len(values) == 0:
        return dict.fromkeys(keys)
    arr = np.asarray(values, dtype=float) * scale
    return dict(zip(keys, [float(arr.mean())] + [float(v) for v in np.percentile(arr, ps)]))


class SSEDecoder:
    """Incremental Server-Sent Events decoder: bytes in, the `data` of each complete event out.

    Handles events split across reads, CRLF line ends, comments and multi-line data.
    """

    def __init__(self):
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events = []
        while True:
            newline = self._buffer.find(b"\n")
            if newline < 0:
                return events
            line = self._buffer[:newline].rstrip(b"\r").decode("utf-8")
            self._buffer = self._buffer[newline + 1:]
            if line == "":
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)

    def close(self) -> list[str]:
        """Whatever a server left without the final blank line."""
        events = self.feed(b"\n\n") if self._buffer or self._data else []
        return events


@dataclass
class ChunkInfo:
    """What one streamed JSON chunk carries."""

    text: Optional[str] = None
    usage_tokens: Optional[int] = None
    usage_prompt_tokens: Optional[int] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None


def parse_chunk(obj: dict, chat: bool) -> ChunkInfo:
    """The text, usage, finish reason or error of one OpenAI completions / chat stream chunk."""
    info = ChunkInfo()
    if "error" in obj:
        err = obj["error"]
        info.error = err.get("message", json.dumps(err)) if isinstance(err, dict) else str(err)
        return info
    usage = obj.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        info.usage_tokens = int(usage["completion_tokens"])
    if isinstance(usage, dict) and usage.get("prompt_tokens") is not None:
        info.usage_prompt_tokens = int(usage["prompt_tokens"])
    choices = obj.get("choices") or []
    if choices:
        choice = choices[0]
        info.text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        info.finish_reason = choice.get("finish_reason")
    return info


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {metric name: value summed over all label sets}."""
    totals: dict[str, float] = {}
    pattern = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")
    for line in text.splitlines():
        match = pattern.match(line)
        if not match or line.startswith("#"):
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        totals[match.group(1)] = totals.get(match.group(1), 0.0) + value
    return totals


# ---------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def token_id_pool(vocab_size: Optional[int], tokenizer=None) -> np.ndarray:
    """The ids random prompts are drawn from: the whole vocabulary but special tokens."""
    size = vocab_size or (len(tokenizer) if tokenizer is not None else None)
    if size is None:
        raise ValueError("random token-id prompts need a vocabulary: pass --vocab-size N or --tokenizer DIR")
    special = set(tokenizer.all_special_ids) if tokenizer is not None else set()
    return np.array([i for i in range(size) if i not in special], dtype=np.int64)


def round_trip_ids(tokenizer, pool: np.ndarray) -> np.ndarray:
    """The ids of `pool` whose own text encodes back to exactly that id (usable in text prompts)."""
    return np.array([i for i in pool if tokenizer.encode(tokenizer.decode([int(i)]), add_special_tokens=False)
                     == [int(i)]], dtype=np.int64)


def text_of_length(tokenizer, rng: np.random.Generator, pool: np.ndarray, length: int) -> str:
    """Text that `tokenizer` encodes (without special tokens) to exactly `length` tokens: random
    ids are appended one at a time, and one that merges with its neighbours is drawn again."""
    ids: list[int] = []
    for _ in range(50 * length):
        if len(ids) == length:
            break
        candidate = ids + [int(rng.choice(pool))]
        if len(tokenizer.encode(tokenizer.decode(candidate), add_special_tokens=False)) == len(candidate):
            ids = candidate
    text = tokenizer.decode(ids)
    if len(tokenizer.encode(text, add_special_tokens=False)) != length:
        raise ValueError(f"could not make text of exactly {length} tokens; use --prompt-type ids or another --tokenizer")
    return text


def random_prompts(cfg: BenchConfig, count: int, seed: int, tokenizer=None) -> list[Prompt]:
    """`count` random prompts of `cfg.input_len` tokens (ids, or text when cfg.prompt_type == 'text')."""
    if cfg.prompt_type == "text" and tokenizer is None:
        raise ValueError("--prompt-type text needs --tokenizer DIR")
    pool = token_id_pool(cfg.vocab_size, tokenizer)
    if cfg.prompt_type == "text":
        pool = round_trip_ids(tokenizer, pool)
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        if cfg.prompt_type == "text":
            body: Any = text_of_length(tokenizer, rng, pool, cfg.input_len)
        else:
            body = [int(i) for i in rng.choice(pool, cfg.input_len)]
        prompts.append(Prompt(body, cfg.input_len, cfg.output_len))
    return prompts


def jsonl_prompts(path: str, count: int, default_max_tokens: int, tokenizer=None) -> list[Prompt]:
    """The first `count` lines of a JSONL file with `prompt` (text or ids) and optional `max_tokens`
    (cycled when the file is shorter). Prompt lengths are counted with `tokenizer` when given."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt" not in row:
                raise ValueError(f"{path}:{number} has no 'prompt' field")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    prompts = []
    for i in range(count):
        row = rows[i % len(rows)]
        body = row["prompt"]
        if isinstance(body, list):
            length = len(body)
        else:
            length = len(tokenizer.encode(body, add_special_tokens=False)) if tokenizer is not None else 0
        prompts.append(Prompt(body, length, int(row.get("max_tokens", default_max_tokens))))
    return prompts


def make_prompts(cfg: BenchConfig, count: int, seed: int, tokenizer=None) -> list[Prompt]:
    if cfg.dataset_path:
        return jsonl_prompts(cfg.dataset_path, count, cfg.output_len, tokenizer)
    return random_prompts(cfg, count, seed, tokenizer)


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


def build_payload(cfg: BenchConfig, prompt: Prompt) -> dict:
    """The streamed request body for one prompt."""
    body: dict[str, Any] = {"model": cfg.model, "max_tokens": prompt.max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.is_chat:
        if not isinstance(prompt.prompt, str):
            raise ValueError("chat endpoints need text prompts: use --prompt-type text or a text dataset")
        body["messages"] = [{"role": "user", "content": prompt.prompt}]
    else:
        body["prompt"] = prompt.prompt
    body.update(cfg.extra_body)
    return body


def headers(cfg: BenchConfig) -> dict:
    h = {"Content-Type": "application/json"}
    if cfg.api_key:
        h["Authorization"] = f"Bearer {cfg.api_key}"
    return h


async def send_request(session: aiohttp.ClientSession, cfg: BenchConfig, prompt: Prompt, index: int,
                       level_start: float) -> RequestResult:
    """Stream one request and time it; any failure is recorded in the result, never raised."""
    result = RequestResult(index, prompt.prompt_len, prompt.max_tokens)
    start = time.perf_counter()
    result.start = start - level_start
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    try:
        async with session.post(cfg.url, json=build_payload(cfg, prompt), headers=headers(cfg),
                                timeout=timeout) as resp:
            if resp.status != 200:
                body = (await resp.content.read(2000)).decode("utf-8", "replace")
                result.error = f"HTTP {resp.status}: {body}"
                return result
            await read_stream(resp, cfg.is_chat, result, start)
    except asyncio.TimeoutError:
        result.error = f"timed out after {cfg.request_timeout_s} s (raise --request-timeout)"
    except (aiohttp.ClientError, OSError, ValueError) as exc:  # ValueError: a chunk that is not JSON
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def read_stream(resp: aiohttp.ClientResponse, chat: bool, result: RequestResult, start: float) -> None:
    """Consume an SSE response into `result`: TTFT, ITLs, chunk count, usage, success."""
    decoder = SSEDecoder()
    state = {"last": None, "done": False}
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        for event in decoder.feed(data):
            if not _take_event(event, chat, result, start, now, state):
                return
    for event in decoder.close():
        if not _take_event(event, chat, result, start, time.perf_counter(), state):
            return
    result.latency = time.perf_counter() - start
    if not state["done"] and result.finish_reason is None:
        result.error = "the stream ended without a finish_reason or data: [DONE]"
        return
    result.success = True


def _take_event(event: str, chat: bool, result: RequestResult, start: float, now: float, state: dict) -> bool:
    """Record one SSE event that arrived at `now`; False when it is an error (the request failed)."""
    if event.strip() == "[DONE]":
        state["done"] = True
        return True
    info = parse_chunk(json.loads(event), chat)
    if info.error is not None:
        result.error = f"error in stream: {info.error}"
        return False
    if info.usage_tokens is not None:
        result.usage_tokens = info.usage_tokens
    if info.usage_prompt_tokens is not None:
        result.usage_prompt_tokens = info.usage_prompt_tokens
    if info.finish_reason:
        result.finish_reason = info.finish_reason
    if info.text:
        result.chunks += 1
        if state["last"] is None:
            result.ttft = now - start
        else:
            result.itl.append(now - state["last"])
        state["last"] = now
    return True


def arrival_delays(count: int, rate: float, seed: int) -> list[float]:
    """Start offsets (s) of `count` requests: all 0 for rate inf, else a Poisson process."""
    if math.isinf(rate):
        return [0.0] * count
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, count)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


async def run_level(session: aiohttp.ClientSession, cfg: BenchConfig, prompts: list[Prompt], concurrency: int,
                    rate: float, seed: int, desc: str = "") -> tuple[list[RequestResult], float]:
    """Send every prompt (arrivals by `rate`, at most `concurrency` in flight; 0 = no bound);
    return the results in prompt order and the level's wall time."""
    semaphore = asyncio.Semaphore(concurrency) if concurrency > 0 else None
    progress = _progress(len(prompts), desc, cfg.disable_tqdm)
    level_start = time.perf_counter()

    async def one(index: int, prompt: Prompt, delay: float) -> RequestResult:
        await asyncio.sleep(max(0.0, level_start + delay - time.perf_counter()))
        if semaphore is None:
            result = await send_request(session, cfg, prompt, index, level_start)
        else:
            async with semaphore:
                result = await send_request(session, cfg, prompt, index, level_start)
        progress.update(1)
        return result

    delays = arrival_delays(len(prompts), rate, seed)
    try:
        results = await asyncio.gather(*(one(i, p, d) for i, (p, d) in enumerate(zip(prompts, delays))))
    finally:
        progress.close()
    return list(results), time.perf_counter() - level_start


def _progress(total: int, desc: str, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=disable, leave=False)


# ---------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------


def aggregate(results: list[RequestResult], duration: float) -> dict:
    """Throughputs and latency statistics (ms) of one level's results."""
    done = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    mismatched = [r for r in done if r.output_tokens != r.expected_tokens]
    # The server counted the prompt differently (text tokenized differently, an added BOS).
    prompt_mismatched = [r for r in done if r.usage_prompt_tokens is not None and r.prompt_len
                         and r.usage_prompt_tokens != r.prompt_len]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "duration_s": duration,
        "completed": len(done),
        "failed": len(failed),
        "errors": sorted({r.error for r in failed if r.error})[:10],
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "output_len_mismatches": len(mismatched),
        "mismatch_examples": [{"index": r.index, "expected": r.expected_tokens, "got": r.output_tokens}
                              for r in mismatched[:5]],
        "prompt_len_mismatches": len(prompt_mismatched),
        "prompt_mismatch_examples": [{"index": r.index, "sent": r.prompt_len, "server_counted": r.usage_prompt_tokens}
                                     for r in prompt_mismatched[:5]],
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else 0.0,
        "ttft_ms": percentiles([r.ttft for r in done if r.ttft is not None], scale=1000),
        "tpot_ms": percentiles([r.tpot for r in done if r.tpot is not None], scale=1000),
        "itl_ms": percentiles([gap for r in done for gap in r.itl], scale=1000),
        "e2el_ms": percentiles([r.latency for r in done if r.latency is not None], scale=1000),
    }


def server_side_summary(before: dict[str, float], after: dict[str, float], level: dict) -> dict:
    """Server-side figures of one level from /metrics scraped before and after it.

    `generation_tokens` is the engine's own count (vllm:generation_tokens_total). The server's
    mean e2e latency (vllm:e2e_request_latency_seconds, arrival at the server to the last token)
    against the client's gives the share of each request's time spent outside the server
    (`hop_overhead_pct`: HTTP, proxy, the stream's way back). `engine_output_throughput` is the
    client's rate scaled by client/server e2e: what the clients would see if that hop were free.
    """
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    count = delta("vllm:e2e_request_latency_seconds_count")
    server_e2e = delta("vllm:e2e_request_latency_seconds_sum") / count if count else None
    ttft_count = delta("vllm:time_to_first_token_seconds_count")
    server_ttft = delta("vllm:time_to_first_token_seconds_sum") / ttft_count if ttft_count else None
    client_e2e = level["e2el_ms"]["mean"]
    summary = {
        "generation_tokens": delta("vllm:generation_tokens_total"),
        "prompt_tokens": delta("vllm:prompt_tokens_total"),
        "finished_requests": count,
        "engine_steps": delta("vllm:engine_steps_total") or None,
        "server_e2el_ms_mean": None if server_e2e is None else server_e2e * 1000,
        "server_ttft_ms_mean": None if server_ttft is None else server_ttft * 1000,
        "hop_overhead_pct": None,
        "engine_output_throughput": None,
    }
    if server_e2e and client_e2e:
        summary["hop_overhead_pct"] = 100.0 * (client_e2e - server_e2e * 1000) / client_e2e
        summary["engine_output_throughput"] = level["output_throughput"] * client_e2e / (server_e2e * 1000)
    return summary


# ---------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------


def sweep_levels(cfg: BenchConfig) -> list[tuple[int, float]]:
    return [(c, r) for c in cfg.concurrencies for r in cfg.request_rates]


async def scrape_metrics(session: aiohttp.ClientSession, cfg: BenchConfig) -> dict[str, float]:
    url = cfg.base_url.rstrip("/") + "/metrics"
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET {url} answered {resp.status}; drop --scrape-metrics for this server")
        return parse_prometheus(await resp.text())


def check_config(cfg: BenchConfig) -> None:
    """Refuse combinations that cannot work, saying what to change."""
    if cfg.prompt_type == "text" and not cfg.tokenizer and not cfg.dataset_path:
        raise ValueError("--prompt-type text needs --tokenizer DIR")
    if cfg.prompt_type == "ids" and not cfg.dataset_path and cfg.vocab_size is None and not cfg.tokenizer:
        raise ValueError("random token-id prompts need a vocabulary: pass --vocab-size N or --tokenizer DIR")
    if cfg.is_chat and cfg.prompt_type == "ids" and not cfg.dataset_path:
        raise ValueError("chat endpoints take text: add --prompt-type text --tokenizer DIR")
    if any(c < 0 for c in cfg.concurrencies) or any(r <= 0 for r in cfg.request_rates):
        raise ValueError("--max-concurrency values must be >= 0 (0: unbounded) and --request-rate values > 0")


async def run_sweep(cfg: BenchConfig) -> dict:
    """Warm up, then run every level; the report holds the config, per-level results and raw timings."""
    check_config(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    # One pool; no keep-alive reuse: a server may close an idle kept-alive connection (llama-server
    # does after 5 s) just as a POST reuses it, which fails the request. Loopback connects are ~0.1 ms.
    connector = aiohttp.TCPConnector(limit=max([cfg.num_prompts, *cfg.concurrencies]) + 2, force_close=True)
    levels = []
    async with aiohttp.ClientSession(connector=connector) as session:
        if cfg.warmup_requests:
            warm = make_prompts(cfg, cfg.warmup_requests, cfg.seed + 10_000, tokenizer)
            results, _ = await run_level(session, cfg, warm, cfg.warmup_requests, math.inf, cfg.seed, "warm-up")
            failures = [r.error for r in results if not r.success]
            if failures:
                raise RuntimeError(f"warm-up requests to {cfg.url} failed: {failures[0]}")
        for number, (concurrency, rate) in enumerate(sweep_levels(cfg)):
            prompts = make_prompts(cfg, cfg.num_prompts, cfg.seed + number, tokenizer)
            before = await scrape_metrics(session, cfg) if cfg.scrape_metrics else None
            desc = f"c={concurrency or 'inf'} rate={rate:g}"
            results, duration = await run_level(session, cfg, prompts, concurrency, rate, cfg.seed + number, desc)
            level = {"concurrency": concurrency, "request_rate": rate, **aggregate(results, duration)}
            if before is not None:
                level["server"] = server_side_summary(before, await scrape_metrics(session, cfg), level)
            level["requests"] = [asdict(r) for r in results]
            _warn_about(level)
            levels.append(level)
    return {"config": asdict(cfg), "levels": levels}


def _warn_about(level: dict) -> None:
    if level["failed"]:
        logger.warning("c=%s: %d requests failed, e.g. %s", level["concurrency"], level["failed"], level["errors"][:1])
    if level["output_len_mismatches"]:
        logger.warning("c=%s: %d requests did not produce the asked number of tokens, e.g. %s (does the server "
                       "honour ignore_eos?)", level["concurrency"], level["output_len_mismatches"],
                       level["mismatch_examples"][:2])
    if level["prompt_len_mismatches"]:
        logger.warning("c=%s: the server counted %d prompts at another length than sent, e.g. %s (it tokenizes "
                       "differently or adds a BOS)", level["concurrency"], level["prompt_len_mismatches"],
                       level["prompt_mismatch_examples"][:2])


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def _fmt(value: Optional[float], digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(report: dict) -> str:
    """A markdown table: one row per level."""
    lines = ["| c | rate | done | failed | mismatch | out tok/s | total tok/s | req/s | TTFT ms mean/p50/p99 "
             "| TPOT ms mean/p50/p99 | ITL ms p50/p99 | E2E ms p50/p99 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lv in report["levels"]:
        t, p, i, e = lv["ttft_ms"], lv["tpot_ms"], lv["itl_ms"], lv["e2el_ms"]
        lines.append(
            f"| {lv['concurrency'] or 'inf'} | {lv['request_rate']:g} | {lv['completed']} | {lv['failed']} "
            f"| {lv['output_len_mismatches']} | {lv['output_throughput']:.1f} | {lv['total_token_throughput']:.1f} "
            f"| {lv['request_throughput']:.2f} | {_fmt(t['mean'])}/{_fmt(t['median'])}/{_fmt(t['p99'])} "
            f"| {_fmt(p['mean'], 2)}/{_fmt(p['median'], 2)}/{_fmt(p['p99'], 2)} "
            f"| {_fmt(i['median'], 2)}/{_fmt(i['p99'], 2)} | {_fmt(e['median'], 0)}/{_fmt(e['p99'], 0)} |")
    servers = [lv for lv in report["levels"] if "server" in lv]
    if servers:
        lines += ["", "| c | server gen tokens | server E2E ms mean | client E2E ms mean | hop overhead % "
                  "| engine out tok/s | client out tok/s |", "|---|---|---|---|---|---|---|"]
        for lv in servers:
            s = lv["server"]
            lines.append(f"| {lv['concurrency'] or 'inf'} | {s['generation_tokens']:.0f} | "
                         f"{_fmt(s['server_e2el_ms_mean'])} | {_fmt(lv['e2el_ms']['mean'])} | "
                         f"{_fmt(s['hop_overhead_pct'], 2)} | {_fmt(s['engine_output_throughput'])} | "
                         f"{lv['output_throughput']:.1f} |")
    return "\n".join(lines)


def plot_reports(reports: dict[str, dict], path: str) -> None:
    """Output throughput, TTFT and TPOT (p50 solid, p99 dashed) against concurrency (or request
    rate), one colour per report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ticks: set[float] = set()
    by_rate = False
    for number, (label, report) in enumerate(reports.items()):
        levels = report["levels"]
        by_rate = len({lv["concurrency"] for lv in levels}) == 1 and len(levels) > 1
        xs = [lv["request_rate"] if by_rate else (lv["concurrency"] or report["config"]["num_prompts"])
              for lv in levels]
        ticks.update(xs)
        color = f"C{number}"
        axes[0].plot(xs, [lv["output_throughput"] for lv in levels], "o-", color=color, label=label)
        for ax, key in ((axes[1], "ttft_ms"), (axes[2], "tpot_ms")):
            ax.plot(xs, [lv[key]["median"] for lv in levels], "o-", color=color, label=f"{label} p50")
            ax.plot(xs, [lv[key]["p99"] for lv in levels], "x--", color=color, label=f"{label} p99")
    for ax, title in zip(axes, ["output tokens/s", "TTFT (ms)", "TPOT (ms)"]):
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks), [f"{t:g}" for t in sorted(ticks)])
        ax.set_xlabel("request rate (req/s)" if by_rate else "max concurrency")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    p.add_argument("--model", required=True, help="the model name the server expects")
    p.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (random dataset)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of each request (ignore_eos)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per level")
    p.add_argument("--max-concurrency", default="1,8,32", help="comma-separated levels; 0 = unbounded")
    p.add_argument("--request-rate", default="inf", help="comma-separated Poisson rates in req/s; inf = all at once")
    p.add_argument("--prompt-type", choices=["ids", "text"], default="ids",
                   help="random prompts as token id lists, or as text (needs --tokenizer)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (text prompts; ids avoid its specials)")
    p.add_argument("--vocab-size", type=int, default=None, help="random ids are drawn below this (default: tokenizer size)")
    p.add_argument("--dataset-path", default=None, help="JSONL with 'prompt' and optional 'max_tokens' per line")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-requests", type=int, default=2, help="unmeasured requests sent first")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (outputs may be shorter)")
    p.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    p.add_argument("--scrape-metrics", action="store_true", help="read the server's /metrics around each level")
    p.add_argument("--output-json", default=None, help="write the full report (config, levels, raw timings) here")
    p.add_argument("--plot", default=None, help="write throughput/latency vs concurrency as a PNG here")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, api_key=args.api_key,
        input_len=args.input_len, output_len=args.output_len, num_prompts=args.num_prompts,
        concurrencies=_ints(args.max_concurrency), request_rates=_rates(args.request_rate),
        prompt_type=args.prompt_type, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
        dataset_path=args.dataset_path, seed=args.seed, warmup_requests=args.warmup_requests,
        request_timeout_s=args.request_timeout, ignore_eos=not args.no_ignore_eos,
        extra_body=json.loads(args.extra_body), scrape_metrics=args.scrape_metrics, disable_tqdm=args.disable_tqdm)


def to_json(report: Any) -> str:
    """Strict JSON: an infinite request rate is written as "inf", a NaN as null."""
    return json.dumps(_finite(report), indent=1, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_outputs(report: dict, output_json: Optional[str], plot: Optional[str], label: str = "server") -> None:
    if output_json:
        Path(output_json).write_text(to_json(report))
        logger.info("wrote %s", output_json)
    if plot:
        plot_reports({label: report}, plot)
        logger.info("wrote %s", plot)


def main(argv: Optional[list[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(args)
    try:
        check_config(cfg)
    except ValueError as exc:
        raise SystemExit(f"serve_bench: {exc}")
    report = asyncio.run(run_sweep(cfg))
    print(format_table(report), flush=True)
    write_outputs(report, args.output_json, args.plot, args.model)
    if any(lv["failed"] for lv in report["levels"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
