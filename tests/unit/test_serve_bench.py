"""benchmarks/serve_bench.py against a local stub server that streams known chunks with known delays.

Fast (a few seconds), only 127.0.0.1. The stub answers /v1/completions with `max_tokens` chunks:
the first after FIRST_S, the rest GAP_S apart, then a usage chunk and [DONE]. Path prefixes
change its behaviour: /fail (HTTP 500), /short (usage one token short), /midfail (an error chunk
after the first token), /nousage (no usage chunk: tokens are counted from chunks).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import threading

import pytest
from aiohttp import web

from benchmarks import serve_bench as sb

STUB = web.AppKey("stub", object)
FIRST_S = 0.05
GAP_S = 0.01


class Stub:
    """The stub's state: request bodies seen, requests in flight now and at most, metric counters."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.generated = 0


async def _completions(request: web.Request) -> web.StreamResponse:
    stub: Stub = request.app[STUB]
    mode = request.match_info.get("mode", "")
    body = await request.json()
    stub.bodies.append(body)
    if mode == "fail":
        return web.json_response({"error": {"message": "engine exploded", "type": "internal_error"}}, status=500)
    stub.in_flight += 1
    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
    try:
        return await _stream(request, stub, body, mode)
    finally:
        stub.in_flight -= 1


async def _stream(request: web.Request, stub: Stub, body: dict, mode: str) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    n = body["max_tokens"]
    await asyncio.sleep(FIRST_S)
    for i in range(n):
        if i:
            await asyncio.sleep(GAP_S)
        if mode == "midfail" and i == 1:
            await resp.write(b'data: {"error": {"message": "boom", "type": "internal_error"}}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            return resp
        chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if i == n - 1 else None}]}
        await resp.write(f"data: {json.dumps(chunk)}\r\n\r\n".encode())  # CRLF on purpose
        stub.generated += 1
    if mode != "nousage":
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n - (mode == "short")}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _metrics(request: web.Request) -> web.Response:
    stub: Stub = request.app[STUB]
    text = (f"# HELP vllm:generation_tokens_total Tokens generated.\n"
            f'vllm:generation_tokens_total{{model_name="m",replica="a"}} {stub.generated}\n'
            f'vllm:generation_tokens_total{{model_name="m",replica="b"}} 0.0\n'
            f"vllm:e2e_request_latency_seconds_sum 0.0\n")
    return web.Response(text=text)


@pytest.fixture(scope="module")
def stub_server():
    """(base_url, Stub) of a stub server running on its own event loop in a thread."""
    stub = Stub()
    app = web.Application()
    app[STUB] = stub
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/{mode}/v1/completions", _completions)
    app.router.add_get("/metrics", _metrics)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", stub
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _config(base_url: str, **overrides) -> sb.BenchConfig:
    values = dict(base_url=base_url, model="stub", input_len=8, output_len=5, num_prompts=6, concurrencies=[1, 3],
                  vocab_size=100, warmup_requests=1, request_timeout_s=30, disable_tqdm=True)
    values.update(overrides)
    return sb.BenchConfig(**values)


# -- pure helpers ---------------------------------------------------------------------------


def test_percentiles():
    stats = sb.percentiles(list(range(1, 101)))
    assert stats == pytest.approx({"mean": 50.5, "median": 50.5, "p95": 95.05, "p99": 99.01})
    assert sb.percentiles([0.002, 0.004], scale=1000) == pytest.approx(
        {"mean": 3.0, "median": 3.0, "p95": 3.9, "p99": 3.98})
    assert sb.percentiles([]) == {"mean": None, "median": None, "p95": None, "p99": None}


def test_sse_decoder_handles_split_events_crlf_comments_and_multiline_data():
    raw = b': keep-alive\r\n\r\ndata: {"a": 1}\r\n\r\ndata:x\ndata: y\n\ndata: [DONE]\n\n'
    decoder = sb.SSEDecoder()
    events = []
    for i in range(len(raw)):  # one byte at a time
        events += decoder.feed(raw[i:i + 1])
    assert events == ['{"a": 1}', "x\ny", "[DONE]"]
    tail = sb.SSEDecoder()
    assert tail.feed(b"data: last") == [] and tail.close() == ["last"]


def test_parse_chunk():
    assert sb.parse_chunk({"choices": [{"text": "hi", "finish_reason": None}]}, chat=False).text == "hi"
    chat = sb.parse_chunk({"choices": [{"delta": {"content": "yo"}, "finish_reason": "stop"}]}, chat=True)
    assert (chat.text, chat.finish_reason) == ("yo", "stop")
    assert sb.parse_chunk({"choices": [], "usage": {"completion_tokens": 7}}, chat=False).usage_tokens == 7
    assert sb.parse_chunk({"error": {"message": "bad"}}, chat=False).error == "bad"


def test_parse_prometheus_sums_label_sets():
    text = '# HELP x y\nvllm:a_total{r="1"} 2.0\nvllm:a_total{r="2"} 3\nvllm:b_sum 1.5e-1 1700000000\n'
    assert sb.parse_prometheus(text) == {"vllm:a_total": 5.0, "vllm:b_sum": 0.15}


def test_aggregate_exact_figures():
    ok = sb.RequestResult(0, 10, 3, success=True, ttft=0.1, latency=0.5, itl=[0.2, 0.2], chunks=3, usage_tokens=3)
    short = sb.RequestResult(1, 10, 3, success=True, ttft=0.3, latency=0.5, itl=[0.2], chunks=2)
    bad = sb.RequestResult(2, 10, 3, error="HTTP 500: x")
    ok.usage_prompt_tokens = 11  # the server saw another prompt length
    level = sb.aggregate([ok, short, bad], duration=2.0)
    assert level["prompt_len_mismatches"] == 1
    assert level["prompt_mismatch_examples"] == [{"index": 0, "sent": 10, "server_counted": 11}]
    assert (level["completed"], level["failed"], level["errors"]) == (2, 1, ["HTTP 500: x"])
    assert (level["total_input_tokens"], level["total_output_tokens"]) == (20, 5)
    assert level["output_len_mismatches"] == 1 and level["mismatch_examples"] == [{"index": 1, "expected": 3, "got": 2}]
    assert level["output_throughput"] == 2.5 and level["total_token_throughput"] == 12.5
    assert level["request_throughput"] == 1.0
    assert level["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert level["tpot_ms"]["mean"] == pytest.approx(200.0)  # (0.5-0.1)/2 and (0.5-0.3)/1
    assert level["itl_ms"]["median"] == pytest.approx(200.0)
    assert level["e2el_ms"]["p99"] == pytest.approx(500.0)


def test_arrival_delays():
    assert sb.arrival_delays(3, math.inf, 0) == [0.0, 0.0, 0.0]
    delays = sb.arrival_delays(2000, 10.0, 1)
    assert delays == sb.arrival_delays(2000, 10.0, 1) and delays[0] == 0.0
    assert delays == sorted(delays) and 180 < delays[-1] < 220  # mean gap 0.1 s


class FakeTokenizer:
    """Greedy longest-match over a tiny vocabulary where "a"+"b" and "c"+"a" merge, plus a token
    ("<x>") whose text does not encode back to itself, and a special token."""

    vocab = ["<eos>", "a", "b", "c", " ", "ab", "ca", "<x>", "?"]
    all_special_ids = [0]

    def __len__(self):
        return len(self.vocab)

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids)

    def encode(self, text, add_special_tokens=False):
        ids = []
        while text:
            match = next((t for t in ("ab", "ca") if text.startswith(t)), text[0])
            ids.append(self.vocab.index(match) if match in self.vocab[1:7] else 8)
            text = text[len(match):]
        return ids


def test_random_prompts_ids_and_text():
    tok = FakeTokenizer()
    assert sorted(sb.round_trip_ids(tok, sb.token_id_pool(None, tok))) == [1, 2, 3, 4, 5, 6, 8]
    cfg = sb.BenchConfig(base_url="x", model="m", input_len=24, prompt_type="text")
    for prompt in sb.random_prompts(cfg, 4, seed=0, tokenizer=tok):
        assert len(tok.encode(prompt.prompt)) == 24
    ids = sb.random_prompts(sb.BenchConfig(base_url="x", model="m", input_len=16), 3, seed=0, tokenizer=tok)
    assert all(len(p.prompt) == 16 and 0 not in p.prompt for p in ids)
    with pytest.raises(ValueError, match="--vocab-size"):
        sb.random_prompts(sb.BenchConfig(base_url="x", model="m"), 1, seed=0)


def test_jsonl_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello", "max_tokens": 3}\n\n{"prompt": [1, 2, 3]}\n')
    prompts = sb.jsonl_prompts(str(path), 3, default_max_tokens=9)
    assert [(p.prompt, p.prompt_len, p.max_tokens) for p in prompts] == [
        ("hello", 0, 3), ([1, 2, 3], 3, 9), ("hello", 0, 3)]


# -- against the stub server ----------------------------------------------------------------


def test_sweep_counts_and_timings(stub_server):
    base_url, stub = stub_server
    stub.bodies.clear()
    stub.max_in_flight = 0
    report = asyncio.run(sb.run_sweep(_config(base_url)))
    assert len(stub.bodies) == 1 + 12  # warm-up + 2 levels x 6
    body = stub.bodies[-1]
    assert body["stream"] is True and body["ignore_eos"] is True and body["temperature"] == 0
    assert body["max_tokens"] == 5 and body["stream_options"] == {"include_usage": True}
    assert len(body["prompt"]) == 8 and all(0 <= t < 100 for t in body["prompt"])
    for level, concurrency in zip(report["levels"], [1, 3]):
        assert level["concurrency"] == concurrency
        assert (level["completed"], level["failed"], level["output_len_mismatches"]) == (6, 0, 0)
        assert level["prompt_len_mismatches"] == 0 and level["requests"][0]["usage_prompt_tokens"] == 8
        assert (level["total_output_tokens"], level["total_input_tokens"]) == (30, 48)
        assert level["output_throughput"] == pytest.approx(30 / level["duration_s"])
        # lower bounds only: the stub's sleeps guarantee them; how much longer a loaded machine takes is luck
        assert level["ttft_ms"]["mean"] >= FIRST_S * 1000
        assert level["tpot_ms"]["median"] >= GAP_S * 1000 * 0.9
        assert sum(len(r["itl"]) for r in level["requests"]) == 6 * 4
        assert level["e2el_ms"]["median"] >= (FIRST_S + 4 * GAP_S) * 1000
        assert level["ttft_ms"]["mean"] <= level["e2el_ms"]["mean"]
    assert report["levels"][0]["duration_s"] >= 6 * (FIRST_S + 4 * GAP_S)  # one at a time
    assert stub.max_in_flight == 3  # the second level ran three at once


def test_prompts_differ_between_levels(stub_server):
    base_url, stub = stub_server
    stub.bodies.clear()
    asyncio.run(sb.run_sweep(_config(base_url, num_prompts=2, concurrencies=[2, 2], warmup_requests=0)))
    first, second = [b["prompt"] for b in stub.bodies[:2]], [b["prompt"] for b in stub.bodies[2:]]
    assert sorted(first) != sorted(second)


def test_compare_sends_new_prompts_in_each_repeated_sweep(stub_server):
    """A server with a prompt cache (llama-server has one) must not see a repeat's prompts again."""
    import argparse
    from pathlib import Path

    from benchmarks import compare

    base_url, stub = stub_server
    args = argparse.Namespace(input_len=8, output_len=4, num_prompts=2, concurrencies=[2], seed=0, warmup_requests=1,
                              disable_tqdm=True, model_name="bench-llama")
    sent = []
    for repeat in range(2):
        stub.bodies.clear()
        config = dataclasses.replace(compare.bench_config(base_url, Path("unused"), args, False, repeat),
                                     tokenizer=None, vocab_size=100)  # random ids without the checkpoint
        asyncio.run(sb.run_sweep(config))
        sent.append([tuple(b["prompt"]) for b in stub.bodies])
    assert len(sent[0]) == len(sent[1]) == 3  # one warm-up + two measured
    assert not set(sent[0]) & set(sent[1])


def test_failing_endpoint_is_counted_with_its_error(stub_server):
    base_url, _ = stub_server
    report = asyncio.run(sb.run_sweep(_config(base_url + "/fail", concurrencies=[2], warmup_requests=0)))
    level = report["levels"][0]
    assert (level["completed"], level["failed"], level["total_output_tokens"]) == (0, 6, 0)
    assert len(level["errors"]) == 1 and level["errors"][0].startswith("HTTP 500")
    assert "engine exploded" in level["errors"][0]
    assert all(r["error"] == level["errors"][0] and not r["success"] for r in level["requests"])
    with pytest.raises(RuntimeError, match="warm-up requests .* failed: HTTP 500"):
        asyncio.run(sb.run_sweep(_config(base_url + "/fail", concurrencies=[2])))


def test_error_inside_the_stream_fails_the_request(stub_server):
    base_url, _ = stub_server
    level = asyncio.run(sb.run_sweep(_config(base_url + "/midfail", concurrencies=[3], warmup_requests=0)))["levels"][0]
    assert (level["completed"], level["failed"], level["errors"]) == (0, 6, ["error in stream: boom"])


def test_short_usage_is_a_mismatch_and_chunks_count_without_usage(stub_server):
    base_url, _ = stub_server
    short = asyncio.run(sb.run_sweep(_config(base_url + "/short", concurrencies=[3])))["levels"][0]
    assert (short["completed"], short["output_len_mismatches"], short["total_output_tokens"]) == (6, 6, 24)
    counted = asyncio.run(sb.run_sweep(_config(base_url + "/nousage", concurrencies=[3])))["levels"][0]
    assert (counted["completed"], counted["output_len_mismatches"], counted["total_output_tokens"]) == (6, 0, 30)


def test_scrape_metrics_reports_server_side_tokens(stub_server):
    base_url, _ = stub_server
    level = asyncio.run(sb.run_sweep(_config(base_url, concurrencies=[3], scrape_metrics=True)))["levels"][0]
    assert level["server"]["generation_tokens"] == 30
    assert level["server"]["server_e2el_ms_mean"] is None  # the stub has no e2e histogram count


def test_server_side_summary_math():
    before = {"vllm:generation_tokens_total": 10, "vllm:e2e_request_latency_seconds_sum": 1.0,
              "vllm:e2e_request_latency_seconds_count": 1}
    after = {"vllm:generation_tokens_total": 50, "vllm:e2e_request_latency_seconds_sum": 4.6,
             "vllm:e2e_request_latency_seconds_count": 5}
    level = {"e2el_ms": {"mean": 1000.0}, "output_throughput": 90.0}
    s = sb.server_side_summary(before, after, level)
    assert s["generation_tokens"] == 40 and s["server_e2el_ms_mean"] == pytest.approx(900.0)
    assert s["hop_overhead_pct"] == pytest.approx(10.0)
    assert s["engine_output_throughput"] == pytest.approx(100.0)


def test_cli_writes_json_and_plot(stub_server, tmp_path, capsys):
    base_url, _ = stub_server
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    sb.main(["--base-url", base_url, "--model", "stub", "--input-len", "4", "--output-len", "3", "--num-prompts",
             "4", "--max-concurrency", "1,4", "--vocab-size", "50", "--disable-tqdm", "--output-json", str(out),
             "--plot", str(png)])
    table = capsys.readouterr().out
    assert table.startswith("| c | rate |") and len([ln for ln in table.splitlines() if ln.startswith("| ")]) == 3
    report = json.loads(out.read_text())
    assert report["config"]["request_rates"] == ["inf"] and len(report["levels"]) == 2
    assert report["levels"][1]["requests"][0]["success"] is True
    assert png.stat().st_size > 1000


def test_cli_exits_nonzero_when_requests_fail(stub_server):
    base_url, _ = stub_server
    with pytest.raises(SystemExit):
        sb.main(["--base-url", base_url + "/fail", "--model", "stub", "--num-prompts", "2", "--max-concurrency",
                 "2", "--vocab-size", "50", "--warmup-requests", "0", "--disable-tqdm"])


def test_config_errors_say_what_to_change():
    with pytest.raises(ValueError, match="--vocab-size N or --tokenizer"):
        sb.check_config(sb.BenchConfig(base_url="x", model="m"))
    with pytest.raises(ValueError, match="--prompt-type text --tokenizer"):
        sb.check_config(sb.BenchConfig(base_url="x", model="m", vocab_size=9, endpoint="/v1/chat/completions"))


def test_compare_serves_the_shipped_config_with_the_benchmarks_model(tmp_path):
    """What the comparison measures is deploy/config.yaml, only the model, limits and port swapped."""
    from pathlib import Path

    import yaml

    from benchmarks import compare

    spec = compare.ours_spec(tmp_path / "ckpt", 8123, compare.parse_args([]), tmp_path)
    written = yaml.safe_load((tmp_path / "ours-serve.yaml").read_text())
    shipped = yaml.safe_load((Path(compare.ROOT) / "deploy" / "config.yaml").read_text())
    assert spec.port == 8123 and written["http_options"] == {"host": "127.0.0.1", "port": 8123}
    assert written["controller_options"] == shipped["controller_options"]
    args, shipped_args = written["applications"][0]["args"], shipped["applications"][0]["args"]
    swapped = {"model": str(tmp_path / "ckpt"), "model_id": "bench-llama", "dtype": "bfloat16", "max_num_seqs": 32,
               "max_model_len": 256}
    assert args == {**shipped_args, "models": [{**shipped_args["models"][0], **swapped}]}


def test_compare_interleaves_systems_each_round_and_drops_a_failed_one(monkeypatch, tmp_path):
    """Rounds alternate systems (drift hits each alike); a system that fails keeps its error and
    sits out the later rounds while the others' reports are kept."""
    from benchmarks import compare

    calls, finished = [], {}
    monkeypatch.setattr(compare, "prepare", lambda systems, args: {"checkpoint": tmp_path})
    monkeypatch.setattr(compare, "make_spec", lambda system, prepared, args, workdir: compare.ServerSpec(
        system, [system], 1, {}, tmp_path))

    def measure(system, spec, checkpoint, args, repeat):
        calls.append((system, repeat))
        if system == "vllm":
            raise RuntimeError("vllm exited")
        return {"system": system, "repeat": repeat}

    monkeypatch.setattr(compare, "measure", measure)
    monkeypatch.setattr(compare, "finish", lambda results, args: finished.update(results))
    compare.main(["--with", "vllm,llamacpp", "--repeats", "2", "--output-dir", str(tmp_path)])
    assert calls == [("ours", 0), ("vllm", 0), ("llamacpp", 0), ("ours", 1), ("llamacpp", 1)]
    assert finished["ours"]["reports"] == [{"system": "ours", "repeat": 0}, {"system": "ours", "repeat": 1}]
    assert finished["vllm"] == {"command": ["vllm"], "error": "vllm exited"}
    assert [r["repeat"] for r in finished["llamacpp"]["reports"]] == [0, 1]
