"""Ahead-of-time compiling for a TPU topology on a host without TPUs: the `jax-serve-aot` command.

It compiles every step program a replica of the given slice would run (engine.tools.aot_compile)
and prints, per program, compile seconds, bytes per chip and collectives, and per config whether
weights and KV pool fit in the chip's HBM. libtpu compiles them (`pip install -e .[tpu-aot]`, in its
own environment: with libtpu installed every JAX process looks for TPUs); nothing runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Optional

from engine.config import EngineConfig, SpeculativeConfig

if TYPE_CHECKING:
    from engine.tools.aot_compile import AotReport


def main(argv: Optional[list[str]] = None) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for the topology; never look for local TPUs
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no TPU is opened: compiles may run side by side
    # after the lines above: jax reads JAX_PLATFORMS when it is imported
    from engine.tools.aot_compile import compile_for_topology, topology_devices

    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    chips = len(topology_devices(args.topology, args.chips_per_host))
    method = {"method": "draft_model", "model": args.draft_model} if args.draft_model else {}
    speculative = SpeculativeConfig(num_tokens=args.speculative_tokens, **method) if args.speculative_tokens else None
    config = EngineConfig(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                          quantization=args.quantization, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, page_size=args.page_size, attention_backend="tpu",
                          kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                          tensor_parallel_size=args.tensor_parallel_size or chips,
                          expert_parallel_size=args.expert_parallel_size, compilation_cache_dir=None,
                          speculative=speculative)
    start = time.perf_counter()
    report = compile_for_topology(config, args.topology, args.chips_per_host)
    print(format_report(report, time.perf_counter() - start))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dataclasses.asdict(report) | {"fits": report.fits, "peak_bytes": report.peak_bytes,
                                                    "planner_error": report.planner_error}, f, indent=2)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a directory with the model's config.json")
    parser.add_argument("--topology", required=True, help="TPU topology, e.g. v5e:2x4, v5p:2x2x2, v4:2x2x4")
    parser.add_argument("--chips-per-host", help="the hosts' shape, e.g. 2x4 for a one-host v5e-8 "
                        "(default: libtpu's for the generation)")
    parser.add_argument("--tensor-parallel-size", type=int, default=0,
                        help="chips the replica spans (default: every chip of the topology)")
    parser.add_argument("--expert-parallel-size", type=int, default=None,
                        help="a mixture of experts: 1 splits each expert's MLP, the tensor-parallel size splits the "
                             "experts whole (default: the planner's choice)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-dtype", default=None)
    parser.add_argument("--quantization", default=None, choices=["int8"], help="weight-only quantization")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory-fraction", type=float, default=0.9)
    parser.add_argument("--speculative-tokens", type=int, default=0,
                        help="guessed tokens per decoding row (speculative decoding: more sampling slots); 0: none")
    parser.add_argument("--draft-model", default=None,
                        help="with --speculative-tokens: a draft model's directory (its config.json); its programs too")
    parser.add_argument("--json", help="also write the report here")
    return parser


def format_report(report: AotReport, seconds: float) -> str:
    mib = lambda n: f"{n / 2**20:,.0f}"  # noqa: E731
    lines = [f"{report.topology} ({report.chips} x {report.device_kind}, {report.hosts} host(s)), "
             f"tensor_parallel_size={report.tensor_parallel_size}: {len(report.programs)} programs in {seconds:.1f} s",
             f"{'program':<44} {'compile s':>9} {'args MiB':>10} {'temp MiB':>9}  collectives"]
    for p in report.programs:
        coll = ", ".join(f"{op} {n}" for op, n in sorted(p.collectives.items())) or "-"
        lines.append(f"{p.name:<44} {p.compile_s:>9.1f} {mib(p.argument_bytes):>10} {mib(p.temp_bytes):>9}  {coll}")
    lines.append(f"per chip: weights {mib(report.weight_bytes)} MiB (planner {mib(report.planned_weight_bytes)}), "
                 f"KV pool {mib(report.kv_bytes)} MiB = {report.kv_pages} pages = {report.kv_tokens:,} tokens "
                 f"({report.sequences} sequences of max_model_len), "
                 f"peak {mib(report.peak_bytes)} of {mib(report.hbm_bytes)} MiB HBM "
                 + (f"(planner {report.planner_error:+.1%}): " if report.planner_error is not None else ": ")
                 + ("fits" if report.fits else f"does not fit ({report.problem or 'temporaries exceed HBM'})")
                 + f"; the smallest tensor_parallel_size that fits here: {report.fits_from or 'none'}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
