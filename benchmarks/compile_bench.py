"""Compile time against depth: every step program of an engine, for models that differ only in layers.

    .venv/bin/python -m benchmarks.compile_bench --layers 4,32 --backend xla,tpu --scan-layers true

For each backend and depth, a random Llama of the bench model's width (hidden 768, 12 heads / 4 KV
heads, intermediate 2048, vocab 32000; made once under ~/.cache/jax-serve) gets an engine with
the default sizes (32 sequences, a 512-token budget, max_model_len 2048) and no persistent
compilation cache; prints the seconds until its first step program was ready (what a replica
waits before it serves) and until the last was, and the ratio of the deepest to the shallowest.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from engine.config import EngineConfig
from engine.generate.engine import LLMEngine

WIDTH = dict(hidden_size=768, num_heads=12, num_kv_heads=4, intermediate_size=2048, vocab_size=32000)


def checkpoint(layers: int) -> Path:
    path = Path.home() / ".cache/jax-serve" / f"bench-llama-{layers}-layers"
    if not (path / "config.json").is_file():
        from tests.support import tiny_models

        tiny_models.make_checkpoint(path, "llama", **WIDTH, num_layers=layers, max_position_embeddings=2048,
                                    initializer_range=0.02, dtype="bfloat16")
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="4,32")
    parser.add_argument("--backend", default="xla,tpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--scan-layers", default="auto", choices=["auto", "true", "false"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    depths = [int(n) for n in args.layers.split(",")]
    print("| backend | layers | step programs | first program s | all programs s |")
    print("|---|---|---|---|---|")
    for backend in args.backend.split(","):
        totals = {}
        for layers in depths:
            scan = {} if args.scan_layers == "auto" else {"scan_layers": args.scan_layers == "true"}
            start = time.perf_counter()
            engine = LLMEngine(EngineConfig(model=str(checkpoint(layers)), dtype=args.dtype, attention_backend=backend,
                                            max_model_len=2048, compilation_cache_dir=None, **scan))
            loaded = time.perf_counter() - start - engine.warmup_seconds  # load, before compiling
            engine.wait_until_compiled()
            totals[layers] = time.perf_counter() - start - loaded
            print(f"| {backend} | {layers} | {engine.stats().step_programs} | {engine.warmup_seconds:.1f} | "
                  f"{totals[layers]:.1f} |", flush=True)
        print(f"| {backend} | {max(depths)} vs {min(depths)} | | | {totals[max(depths)] / totals[min(depths)]:.2f}x |")


if __name__ == "__main__":
    main()
