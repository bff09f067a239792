"""Offline engine benchmark: output tokens/s and per-step latency at several batch sizes.

    .venv/bin/python benchmarks/engine_bench.py --batch 1,8,32
    .venv/bin/python benchmarks/engine_bench.py --batch 8,32 --requests 64   # the serving benchmark's pattern

Work: a random Llama of ~110M parameters (hidden 768, 12 layers, 12 heads / 4 KV heads,
intermediate 2048, vocab 32000, made once under ~/.cache/jax-serve/bench-llama), `--prompt-len`
random prompt tokens and `--new-tokens` new tokens per request with EOS ignored, `batch` requests
submitted at once; with `--requests N`, a closed loop like `jax-serve-bench --max-concurrency batch`:
each finished request is replaced by a new one until N have run (the engine's ceiling under the
serving comparison, without HTTP, Ray or detokenizing). Compile time is excluded (the engine warms up
first). Prints one row per batch size; each figure is the median of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from engine.core.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402

BENCH_MODEL = dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=2048,
                   vocab_size=32000, max_position_embeddings=2048, initializer_range=0.02, dtype="bfloat16")


def bench_checkpoint(path: Path) -> Path:
    """The random ~110M Llama (bf16 safetensors), made on first use."""
    if not (path / "config.json").is_file():
        import tiny_models

        tiny_models.make_checkpoint(path, "llama", **BENCH_MODEL)
    return path


def run_once(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, seed: int,
             requests: int | None = None) -> dict:
    """`batch` requests at once; with `requests`, each finished one is replaced until that many ran."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    submitted = 0

    def submit() -> None:
        nonlocal submitted
        engine.add_request(f"b{seed}-{submitted}", [int(t) for t in rng.integers(0, engine.vocab_size, prompt_len)],
                           params)
        submitted += 1

    for _ in range(batch):
        submit()
    step_times, decode_times, produced = [], [], 0
    start = time.perf_counter()
    while engine.has_work():
        t0 = time.perf_counter()
        deltas = engine.step()
        elapsed = time.perf_counter() - t0
        step_times.append(elapsed)
        if engine.stats().num_waiting == 0 and all(len(d.token_ids) == 1 for d in deltas) and len(deltas) == batch:
            decode_times.append(elapsed)
        produced += sum(len(d.token_ids) for d in deltas)
        for _ in range(sum(d.finished for d in deltas) if requests else 0):
            if submitted < requests:
                submit()
    total = time.perf_counter() - start
    return {"tok_s": produced / total, "step_ms": 1000 * statistics.median(decode_times or step_times),
            "seconds": total, "steps": len(step_times), "tokens": produced, "requests": submitted}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path.home() / ".cache/jax-serve/bench-llama")
    parser.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--prefill-chunk", type=int, default=128)
    parser.add_argument("--requests", type=int, default=None,
                        help="closed loop: keep `batch` requests running until this many have run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "xla", "tpu"],
                        help="the engine's attention backend (auto: cpu kernels on x86 CPUs)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--num-hosts", type=int, default=1,
                        help="run the model on this many EngineWorker processes (a local Ray instance)")
    parser.add_argument("--devices-per-host", type=int, default=0,
                        help="host CPU devices per process (XLA_FLAGS), for --tensor-parallel-size > 1 on a CPU")
    parser.add_argument("--cpu-matmul", default="auto", choices=["auto", "kernel", "xla"],
                        help="cpu backend: per-shape choice (auto) or one matmul for every product")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    model = bench_checkpoint(args.model)
    if args.devices_per_host and args.num_hosts == 1:
        import os

        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices_per_host}"
    if args.num_hosts > 1:
        import ray

        env = {"JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
        if args.devices_per_host:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices_per_host}"
        ray.init(address="local", include_dashboard=False, runtime_env={"env_vars": env})
    batches = [int(b) for b in args.batch.split(",")]
    for batch in batches:
        engine = LLMEngine(EngineConfig(
            model=str(model), dtype=args.dtype, page_size=args.page_size, max_num_seqs=batch,
            max_num_batched_tokens=max(batch, args.max_num_batched_tokens), prefill_chunk=args.prefill_chunk,
            max_model_len=args.prompt_len + args.new_tokens, attention_backend=args.attention_backend,
            tensor_parallel_size=args.tensor_parallel_size, cpu_matmul=args.cpu_matmul, num_hosts=args.num_hosts))
        if batch == batches[0]:
            d = engine.describe()
            print(f"| batch | output tok/s | decode step ms | run s | steps |  ({d['dtype']}, {d['attention_backend']} "
                  f"backend, cpu_matmul {args.cpu_matmul}, tp={d['tensor_parallel_size']}, hosts={d['num_hosts']}, "
                  f"{args.prompt_len} in / "
                  f"{args.new_tokens} out)")
            print("|---|---|---|---|---|")
        runs = [run_once(engine, batch, args.prompt_len, args.new_tokens, seed, args.requests)
                for seed in range(args.repeats)]
        if args.num_hosts > 1:
            engine.runner.shutdown()  # the next batch size starts its own workers
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"| {batch} | {med['tok_s']:.0f} | {med['step_ms']:.1f} | {med['seconds']:.2f} | {med['steps']:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
