"""Cache-aware routing on vs off: a multi-turn chat workload over two replicas of one model.

    .venv/bin/python -m benchmarks.routing_bench                        # both routers, one after the other
    .venv/bin/python -m benchmarks.routing_bench --conversations 16 --turns 4 --concurrency 8

Serves compare.py's benchmark checkpoint (a random ~110M Llama, bf16) with two model-server
replicas in a local Ray instance, once with `request_router: power_of_two` (Ray Serve's default)
and once with `prefix_affinity`, the same workload each time: `--conversations` conversations,
`--concurrency` of them at a time, each `--turns` turns long. A conversation starts from its own
`--context` token ids (a document, a long system prompt); every turn appends a `--question` of
fresh ids and sends the whole history as a streamed /v1/completions prompt for `--answer` tokens;
the next turn's prompt carries an answer of that many fresh ids (what a client sends back as the
assistant's turn; fresh ids so that the hits counted are the context's and the earlier turns'). Reported per router: the
prefix-cache hit rate over both replicas (hit / looked-up prompt tokens, from /metrics), TTFT
(median, p90) of first turns and of later turns, and the wall time. Both replicas share the
machine's cores, so the absolute times are the machine's; the difference is the router's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from pathlib import Path

import aiohttp
import numpy as np

from benchmarks import serve_bench
from benchmarks.compare import DEFAULT_CACHE, MODEL_NAME, prepare_checkpoint

ROOT = Path(__file__).resolve().parents[1]


logger = logging.getLogger("routing_bench")
ROUTERS = ("power_of_two", "prefix_affinity")


async def conversation(session: aiohttp.ClientSession, url: str, rng: np.random.Generator, args) -> list[dict]:
    """One conversation's turns: [{turn, ttft_s, prompt_tokens}]."""
    history = rng.integers(100, args.vocab, args.context).tolist()
    turns = []
    for turn in range(args.turns):
        history += rng.integers(100, args.vocab, args.question).tolist()
        body = {"model": MODEL_NAME, "prompt": history, "max_tokens": args.answer, "temperature": 0,
                "ignore_eos": True, "stream": True}
        start = time.perf_counter()
        first = None
        async with session.post(f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.content:
                text = line.decode().strip()
                if not text.startswith("data: ") or text == "data: [DONE]":
                    continue
                chunk = json.loads(text[len("data: "):])
                if chunk["choices"] and chunk["choices"][0]["text"] and first is None:
                    first = time.perf_counter() - start
        turns.append({"turn": turn, "ttft_s": first, "prompt_tokens": len(history)})
        history += rng.integers(100, args.vocab, args.answer).tolist()
    return turns


async def workload(url: str, args) -> tuple[list[dict], float]:
    rng = np.random.default_rng(args.seed)
    seeds = rng.integers(0, 2**31, args.conversations)
    gate = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(seed):
            async with gate:
                return await conversation(session, url, np.random.default_rng(seed), args)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(s) for s in seeds))
        return [t for turns in results for t in turns], time.perf_counter() - start


def cache_counts(url: str) -> tuple[float, float]:
    import urllib.request

    metrics = serve_bench.parse_prometheus(urllib.request.urlopen(f"{url}/metrics").read().decode())
    return (sum(v for k, v in metrics.items() if k.startswith("vllm:prefix_cache_hits")),
            sum(v for k, v in metrics.items() if k.startswith("vllm:prefix_cache_queries")))


def serve_and_run(router: str, checkpoint: Path, args) -> dict:
    import urllib.request

    from ray import serve

    from serve_app import build_app

    port = 8000 + ROUTERS.index(router) + 17
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    app = build_app({"model": str(checkpoint), "model_id": MODEL_NAME, "num_replicas": 2, "num_cpus": 0.5,
                     "dtype": "bfloat16", "max_num_seqs": 8, "max_model_len": args.max_model_len,
                     "request_router": router, "engine_niceness": None})
    serve.run(app, name="routing", route_prefix="/")
    try:
        def compiled() -> bool:
            models = json.loads(urllib.request.urlopen(f"{url}/health").read())["models"]
            state = models[MODEL_NAME]
            return state.get("replicas") == 2 and state.get("compiled_programs") == state.get("step_programs")

        deadline = time.monotonic() + 1800
        while True:
            try:
                if compiled():
                    break
            except Exception:  # noqa: BLE001 -- not up yet
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the replicas did not finish compiling in 30 minutes")
            time.sleep(2)
        hits0, queries0 = cache_counts(url)
        turns, wall = asyncio.run(workload(url, args))
        hits, queries = cache_counts(url)
        first = [t["ttft_s"] for t in turns if t["turn"] == 0]
        later = [t["ttft_s"] for t in turns if t["turn"] > 0]
        return {"router": router, "hit_rate": (hits - hits0) / max(queries - queries0, 1), "wall_s": wall,
                "requests": len(turns), "ttft_first_ms": _stats(first), "ttft_later_ms": _stats(later),
                "ttft_all_ms": _stats(first + later)}
    finally:
        serve.delete("routing")
        serve.shutdown()


def _stats(values: list[float]) -> dict:
    ms = sorted(v * 1000 for v in values)
    return {"median": statistics.median(ms), "p90": ms[int(0.9 * (len(ms) - 1))], "mean": statistics.fmean(ms)}


def table(results: list[dict]) -> str:
    rows = ["| router | prefix-cache hit rate | TTFT median / p90, all turns (ms) | later turns (ms) "
            "| first turns (ms) | wall (s) |", "|---|---|---|---|---|---|"]
    for r in results:
        t, later, first = r["ttft_all_ms"], r["ttft_later_ms"], r["ttft_first_ms"]
        rows.append(f"| {r['router']} | {100 * r['hit_rate']:.1f}% | {t['median']:.0f} / {t['p90']:.0f} | "
                    f"{later['median']:.0f} / {later['p90']:.0f} | {first['median']:.0f} / {first['p90']:.0f} | "
                    f"{r['wall_s']:.1f} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8, help="conversations at a time")
    parser.add_argument("--context", type=int, default=320, help="token ids each conversation starts from")
    parser.add_argument("--question", type=int, default=24, help="token ids a turn adds")
    parser.add_argument("--answer", type=int, default=16, help="tokens each turn generates")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--max-model-len", type=int, default=512, help="the checkpoint's own limit")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    checkpoint = prepare_checkpoint(args.cache / MODEL_NAME)

    import ray

    ray.init(address="local", include_dashboard=False, logging_level="WARNING")
    try:
        results = [serve_and_run(router, checkpoint, args) for router in args.routers.split(",")]
    finally:
        ray.shutdown()
    print(table(results))
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
