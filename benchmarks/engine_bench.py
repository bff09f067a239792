"""Offline engine benchmark: output tokens/s and per-step latency at several batch sizes.

    .venv/bin/python -m benchmarks.engine_bench --batch 1,8,32
    .venv/bin/python -m benchmarks.engine_bench --batch 8,32 --requests 64   # the serving benchmark's pattern

Work: a random Llama made once under ~/.cache/jax-serve (`--shape bench-110m`: hidden 768, 12 layers,
12 heads / 4 KV heads, intermediate 2048, vocab 32000; `--shape llama-3.2-1b`: Llama-3.2-1B's shape,
1.24B parameters, tied embeddings), `--prompt-len`
random prompt tokens and `--new-tokens` new tokens per request with EOS ignored, `batch` requests
submitted at once; with `--requests N`, a closed loop like `python -m benchmarks.serve_bench --max-concurrency batch`:
each finished request is replaced by a new one until N have run (the engine's ceiling under the
serving comparison, without HTTP, Ray or detokenizing). Compile time is excluded (the engine warms up
first). Prints one row per batch size; each figure is the median of `--repeats` runs. "of batch /
step" is output tok/s as a share of batch / decode step, what the run would make if every step
were a full batch of decodes: the rest went to prefill and to steps with fewer rows.

`--grammar none,json` runs each batch size both free and under a JSON schema (structured output:
an array of strings that cannot close before `--new-tokens`, so both produce as many tokens),
interleaved round by round on the same engine; one row per batch size and grammar.

`--lora-rank R` gives the engine one LoRA slot of rank R and runs every request with a random
adapter of that rank on every projection (made once beside the checkpoint): against a run without
it, what adapters cost a step.

`--fp8` serves an FP8 copy of the checkpoint (engine.layers.fp8; made beside it once): against the
same run without it, what FP8 weights (a byte a value, scales per 128 x 128 block) do to a step.

`--one-engine` serves every batch size from one engine sized for the largest (one load and warm-up,
as an accelerator run wants); `--bandwidth-bound` times a device-memory copy and prints the batch-1
decode step against the bound it implies (checkpoint bytes / copy bandwidth: each decode step reads
every weight once).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

import numpy as np

from engine.config import ATTENTION_BACKENDS, EngineConfig
from engine.generate.engine import LLMEngine
from engine.generate.request import Grammar, SamplingParams

SHAPES = {
    "bench-110m": dict(family="llama", hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4,
                       intermediate_size=2048, vocab_size=32000),
    "llama-3.2-1b": dict(family="llama", hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                         intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    # A Qwen3-MoE of ~1.0B total / ~0.2B active parameters (64 experts of 384, 8 a token), and a dense
    # Qwen3 of the same active size (an MLP of 8 x 384).
    "qwen3-moe-1b": dict(family="qwen3_moe", hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=4,
                         intermediate_size=3072, num_experts=64, experts_per_token=8, expert_intermediate_size=384,
                         vocab_size=32000),
    "qwen3-0.2b": dict(family="qwen3", hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=4,
                       intermediate_size=3072, vocab_size=32000),
}
DEFAULT_PATHS = {"bench-110m": "bench-llama", "llama-3.2-1b": "bench-llama-3.2-1b", "qwen3-moe-1b": "bench-qwen3-moe",
                 "qwen3-0.2b": "bench-qwen3-0.2b"}


def bench_checkpoint(path: Path, shape: str, **extra) -> Path:
    """A random model of `shape` (bf16 safetensors), made on first use; `extra`: more of
    tests.support.tiny_models.make_checkpoint's arguments."""
    if not (path / "config.json").is_file():
        from tests.support import tiny_models

        sizes = dict(SHAPES[shape])
        tiny_models.make_checkpoint(path, sizes.pop("family"), **sizes, max_position_embeddings=2048,
                                    initializer_range=0.02, dtype="bfloat16", **extra)
    return path


def bench_adapter(model: Path, rank: int) -> Path:
    """A random PEFT adapter of `rank` on every projection of the benchmark model (made once beside it)."""
    path = model.parent / f"{model.name}-lora-r{rank}"
    if not (path / "adapter_model.safetensors").is_file():
        from tests.support import tiny_models

        tiny_models.make_lora_adapter(model, path, rank=rank, scale=0.01)
    return path


def copy_bandwidth(gib: int = 4, repeats: int = 10) -> float:
    """Bytes/s of a device-memory copy (read + write) of a `gib` GiB array on the default device."""
    import jax
    import jax.numpy as jnp

    x = jnp.zeros((gib << 28,), jnp.float32)  # float32: XLA's CPU backend widens bfloat16 arithmetic
    add = jax.jit(lambda a: a + 1)
    add(x).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        add(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * x.nbytes / statistics.median(times)


def served_weight_bytes(engine, model: Path) -> int:
    """The bytes of the weights as the engine serves them (quantized, packed); the checkpoint's
    files when the model lives in other processes."""
    import jax

    runner = engine.executor.runner  # None: the model lives in other processes (several hosts)
    if runner is None:
        return sum(f.stat().st_size for f in model.glob("*.safetensors"))
    arrays = {id(leaf): leaf for leaf in jax.tree_util.tree_leaves(runner.model) if isinstance(leaf, jax.Array)}
    return sum(leaf.nbytes for leaf in arrays.values())  # a tied LM head's plain matrix is the embedding itself


BENCH_SCHEMA = '{"type": "array", "items": {"type": "string"}, "minItems": 100000}'
"""JSON the output cannot complete within any benchmark's length: every request runs to max_tokens."""
GRAMMARS = {"none": None, "json": Grammar("json_schema", BENCH_SCHEMA)}


def run_once(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, seed: int,
             requests: int | None = None, grammar: str = "none", adapter: str | None = None) -> dict:
    """`batch` requests at once; with `requests`, each finished one is replaced until that many ran.
    `adapter`: every request runs with this LoRA adapter."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, grammar=GRAMMARS[grammar])
    submitted = 0

    def submit() -> None:
        nonlocal submitted
        engine.add_request(f"b{seed}-{submitted}", [int(t) for t in rng.integers(0, engine.vocab_size, prompt_len)],
                           params, adapter)
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


def time_to_first_token(engine: LLMEngine, prompt_len: int, seed: int) -> float:
    """Seconds from adding one `prompt_len`-token request to an idle engine to its first token."""
    prompt = np.random.default_rng(seed).integers(3, 500, size=prompt_len).tolist()
    start = time.perf_counter()
    engine.add_request(f"ttft-{seed}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while not any(d.token_ids for d in engine.step()):
        pass
    seconds = time.perf_counter() - start
    while engine.has_work():
        engine.step()
    return seconds


def replay_step_ms(engine: LLMEngine, batch: int, steps: int = 50) -> float:
    """The device side alone: `steps` padding-only decode steps of `batch` rows (the bucket and
    the work of a real one) launched back to back and fetched once, per step. What the runner's
    dispatch and the device take, without scheduling or reading each step's tokens."""
    from engine.generate.planner import empty_step_plan

    runner = engine.executor.runner
    buckets = runner.facts.buckets
    plan = empty_step_plan(buckets.for_step(batch, batch), buckets, step_id=-1)
    runner.fetch(runner.launch(plan))
    start = time.perf_counter()
    for _ in range(steps):
        handle = runner.launch(plan)
    runner.fetch(handle)
    return 1000 * (time.perf_counter() - start) / steps


def engine_config(args, model: Path, seqs: int, max_model_len: int) -> EngineConfig:
    optional = {"prefill_chunk": args.prefill_chunk} if args.prefill_chunk else {}
    if args.scan_layers != "auto":
        optional["scan_layers"] = args.scan_layers == "true"
    if args.lora_rank:
        optional.update(max_loras=1, max_lora_rank=args.lora_rank)
    if args.quantization:  # only where asked: older checkouts' configs have no such field
        optional["quantization"] = args.quantization
    return EngineConfig(model=str(model), dtype=args.dtype, page_size=args.page_size, max_num_seqs=seqs,
                        max_num_batched_tokens=max(seqs, args.max_num_batched_tokens), max_model_len=max_model_len,
                        attention_backend=args.attention_backend, tensor_parallel_size=args.tensor_parallel_size,
                        cpu_matmul=args.cpu_matmul, num_hosts=args.num_hosts, num_pages=args.num_pages, **optional)


def fp8_checkpoint(model: Path) -> Path:
    """`model`'s FP8 copy (`<model>-fp8`, blocks of 128 x 128), made on first use."""
    out = model.with_name(f"{model.name}-fp8")
    if not (out / "config.json").is_file():
        import shutil

        from tests.support.fp8_checkpoints import make_fp8_checkpoint

        _, reference = make_fp8_checkpoint(model, out, block=(128, 128))
        shutil.rmtree(reference)  # the float32 copy transformers would read: not needed here
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="bench-110m", choices=sorted(SHAPES))
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint directory (default: ~/.cache/jax-serve/<the shape's name>)")
    parser.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--quantization", default=None, choices=["int8"], help="weight-only quantization")
    parser.add_argument("--fp8", action="store_true",
                        help="serve an FP8 copy of the checkpoint (block-wise, 128 x 128, as DeepSeek's and Qwen's "
                             "FP8 releases), made beside it on first use")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--prefill-chunk", type=int, default=None, help="prompt tokens per row per step (default: the budget)")
    parser.add_argument("--ttft", type=int, default=None, metavar="PROMPT_LEN",
                        help="instead: the median time to first token of one PROMPT_LEN-token prompt on an idle engine")
    parser.add_argument("--requests", type=int, default=None,
                        help="closed loop: keep `batch` requests running until this many have run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--grammar", default="none",
                        help="comma-separated: none (free text), json (every request under BENCH_SCHEMA)")
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                        help="the engine's attention backend (auto: cpu kernels on x86 CPUs)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--num-hosts", type=int, default=1,
                        help="run the model on this many EngineWorker processes (a local Ray instance)")
    parser.add_argument("--devices-per-host", type=int, default=0,
                        help="host CPU devices per process (XLA_FLAGS), for --tensor-parallel-size > 1 on a CPU")
    parser.add_argument("--scan-layers", default="auto", choices=["auto", "true", "false"],
                        help="the layer loop: scanned, unrolled, or the backend's choice")
    parser.add_argument("--cpu-matmul", default="auto", choices=["auto", "kernel", "xla"],
                        help="cpu backend: per-shape choice (auto) or one matmul for every product")
    parser.add_argument("--num-pages", type=int, default=0,
                        help="KV pool pages (0: the engine's rule, most of an accelerator's free memory)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="with --ttft: the engine's (default 32)")
    parser.add_argument("--one-engine", action="store_true",
                        help="one engine sized for the largest batch serves every batch size")
    parser.add_argument("--replay", action="store_true",
                        help="add a column: a decode step of the runner alone (see replay_step_ms)")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="every request runs with a random LoRA adapter of this rank on every projection")
    parser.add_argument("--bandwidth-bound", action="store_true",
                        help="time a device-memory copy and compare the batch-1 decode step with its bound")
    args = parser.parse_args(argv)
    if args.replay and args.num_hosts > 1:
        parser.error("--replay times one process's runner; drop it with --num-hosts > 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    model = bench_checkpoint(args.model or Path.home() / ".cache/jax-serve" / DEFAULT_PATHS[args.shape], args.shape)
    if args.fp8:
        model = fp8_checkpoint(model)
    if args.devices_per_host and args.num_hosts == 1:
        import os

        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices_per_host}"
    if args.num_hosts > 1:
        import ray

        env = {"JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
        if args.devices_per_host:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices_per_host}"
        ray.init(address="local", include_dashboard=False, runtime_env={"env_vars": env})
    if args.ttft:
        engine = LLMEngine(engine_config(args, model, args.max_num_seqs or 32, args.ttft + 1))
        if hasattr(engine, "wait_until_compiled"):
            engine.wait_until_compiled()
        times = [time_to_first_token(engine, args.ttft, seed) for seed in range(args.repeats)]
        print(f"time to first token of a {args.ttft}-token prompt: median {statistics.median(times):.3f} s "
              f"(runs: {', '.join(f'{t:.3f}' for t in times)}; budget {args.max_num_batched_tokens}, "
              f"prefill_chunk {args.prefill_chunk or 'the budget'}, {engine.describe()['attention_backend']} backend)")
        return
    bandwidth = copy_bandwidth() if args.bandwidth_bound else None  # before an engine takes the memory
    batches = [int(b) for b in args.batch.split(",")]
    grammars = args.grammar.split(",")
    if set(grammars) - set(GRAMMARS):
        parser.error(f"--grammar takes {', '.join(GRAMMARS)}")
    step_ms = {}
    engine = None
    for batch in batches:
        if engine is None or not args.one_engine:
            seqs = max(batches) if args.one_engine else batch
            engine = LLMEngine(engine_config(args, model, seqs, args.prompt_len + args.new_tokens))
            if args.lora_rank:
                engine.add_adapter("bench", str(bench_adapter(model, args.lora_rank)))
            if hasattr(engine, "wait_until_compiled"):  # older checkouts compiled everything up front
                engine.wait_until_compiled()  # steady state: every step program compiled
        if batch == batches[0]:
            d = engine.describe()
            print(f"| batch | grammar | output tok/s | decode step ms | of batch / step | run s | steps |"
                  f"{' replayed step ms |' * args.replay}"
                  f"  ({d['dtype']}, {d['attention_backend']} "
                  f"backend, cpu_matmul {args.cpu_matmul}, tp={d['tensor_parallel_size']}, hosts={d['num_hosts']}, "
                  f"{args.prompt_len} in / "
                  f"{args.new_tokens} out)")
            print("|---|---|---|---|---|---|---|" + "---|" * args.replay)
        runs = {g: [] for g in grammars}
        for seed in range(args.repeats):  # interleaved: drift hits every grammar alike
            for g in grammars:
                runs[g].append(run_once(engine, batch, args.prompt_len, args.new_tokens, seed, args.requests, g,
                                        "bench" if args.lora_rank else None))
        if args.num_hosts > 1 and not args.one_engine:
            engine.shutdown()  # the next batch size starts its own workers
        replayed = f" {replay_step_ms(engine, batch):.2f} |" if args.replay and args.num_hosts == 1 else ""
        for g in grammars:
            med = {k: statistics.median(r[k] for r in runs[g]) for k in runs[g][0]}
            step_ms.setdefault(batch, med["step_ms"])
            ceiling = 1000 * batch / med["step_ms"]  # every step a full batch of decodes
            print(f"| {batch} | {g} | {med['tok_s']:.0f} | {med['step_ms']:.2f} | {med['tok_s'] / ceiling:.0%} | "
                  f"{med['seconds']:.2f} | {med['steps']:.0f} |{replayed}", flush=True)
    if args.num_hosts > 1 and args.one_engine:
        engine.shutdown()
    if bandwidth:
        weight_bytes = served_weight_bytes(engine, model)
        bound_ms = 1000 * weight_bytes / bandwidth
        print(f"weights {weight_bytes / 1e9:.3f} GB, copy bandwidth {bandwidth / 1e9:.0f} GB/s, "
              f"batch-1 bound {bound_ms:.3f} ms" + (f", batch-1 step {step_ms[1]:.3f} ms = "
                                                  f"{step_ms[1] / bound_ms:.2f}x the bound" if 1 in step_ms else ""))


if __name__ == "__main__":
    main()
