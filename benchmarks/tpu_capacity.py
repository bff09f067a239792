"""The TPU capacity table of docs/benchmarks.md: every step program of four model shapes compiled
for four TPU slices on this host (engine.tools.aot_compile), beside the planner's figures.

    .venv-tpu/bin/python -m benchmarks.tpu_capacity [--models llama-3.2-1b ...] [--topologies v5e:2x4 ...]

Each cell compiles at tensor_parallel_size = every device of the slice (a replica spanning it) and
names the smallest size that fits (engine.generate.runner.memory_plan). The models are config.json files only
(benchmarks/model_shapes): no weights are needed to compile.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from pathlib import Path

SHAPES = Path(__file__).parent / "model_shapes"
MODELS = ("llama-3.2-1b", "llama-3.1-8b", "qwen3-32b", "llama-3.1-70b")
TOPOLOGIES = ("v5e:2x4", "v6e:2x4", "v5p:2x2x2", "v4:2x2x4")
CHIPS_PER_HOST = {"v5e:2x4": "2x4", "v6e:2x4": "2x4"}
"""v5e-8 and v6e-8 are one host of 8 chips; v5p and v4 hosts hold 4 chips (libtpu's default)."""


def cell(model: str, topology: str) -> str:
    from engine.config import EngineConfig
    from engine.tools import aot_compile

    devices = aot_compile.topology_devices(topology, CHIPS_PER_HOST.get(topology))
    config = EngineConfig(model=str(SHAPES / model), attention_backend="tpu", tensor_parallel_size=len(devices),
                          compilation_cache_dir=None)
    start = time.perf_counter()
    try:
        report = aot_compile.compile_for_topology(config, topology, CHIPS_PER_HOST.get(topology))
    except Exception as exc:  # noqa: BLE001 -- a cell that does not compile is a finding
        traceback.print_exc()
        return (f"| {model} | {topology} | {len(devices)} | - | - | - | - | "
                f"does not compile: {str(exc).splitlines()[0][:160]} |")
    seconds = time.perf_counter() - start
    fits_from = report.fits_from or "none"
    if not report.programs:
        return (f"| {model} | {topology} | {len(devices)} (fits from {fits_from}) | - | - | - | - | "
                f"no: {report.problem} |")
    forward = [p for p in report.programs if p.name.startswith("forward")]
    largest = max(forward, key=lambda p: int(p.name.split("=")[1]))
    peak = max(report.programs, key=lambda p: p.peak_bytes)
    gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
    collectives = ", ".join(f"{n} {op}" for op, n in sorted(largest.collectives.items())) or "none"
    return (f"| {model} | {topology} ({report.hosts} host{'s' if report.hosts > 1 else ''}) | "
            f"{report.tensor_parallel_size} (fits from {fits_from}) | "
            f"{largest.compile_s:.1f} / {seconds:.0f} ({len(report.programs)}) | "
            f"{gib(report.weight_bytes)} / {gib(report.kv_bytes)} / {gib(peak.temp_bytes + peak.code_bytes)} = "
            f"{gib(report.peak_bytes)} "
            f"of {gib(report.hbm_bytes)} ({_percent(report.planner_error)}) | {report.kv_tokens:,} | {collectives} | "
            f"{'yes' if report.fits else 'no: ' + (report.problem or 'temporaries')} |")


def _percent(error) -> str:
    return "-" if error is None else f"{error:+.1%}"


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--topologies", nargs="+", default=TOPOLOGIES)
    args = parser.parse_args()
    print("| model | slice | TP | compile s: largest / all (programs) | GiB per device: weights / KV / temp + code = "
          "peak of HBM (planner vs peak) | KV tokens | collectives per step (largest program) | fits |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for topology in args.topologies:
            print(cell(model, topology), flush=True)


if __name__ == "__main__":
    main()
