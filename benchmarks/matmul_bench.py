"""The CPU matmul paths side by side on a model's product shapes.

    .venv/bin/python -m benchmarks.matmul_bench --rows 32,128,512,2048
    PYTHONPATH=/tmp/base .venv/bin/python -m benchmarks.matmul_bench   # another checkout's kernel

For each row count and each of a layer's products (SmolLM2-135M's by default: fused q/k/v, the
attention output, fused gate/up, down), f32[rows, in] times a bfloat16 weight on: the kernel over
packed panels on 8-lane vectors and (where the CPU has AVX-512) on 16-lane ones, XLA's dot on
bf16 activations, and XLA's dot on fp32 activations over the weight widened in the step (what
`cpu_matmul: auto` chooses among). All are compiled in one process and timed alternately; prints
the median of `--repeats` runs in ms and GFLOP/s. `--reference` adds PyTorch's float32 and bfloat16
products (oneDNN / MKL on x86) on as many threads as this process may use: what a tuned BLAS
reaches on the same host.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from engine.backends.cpu import kernels

SMOLLM2 = "576x960,576x576,576x3072,1536x576"
"""in x out of SmolLM2-135M's four products per layer."""


def paths(wide: bool) -> dict:
    """name -> (jitted product, whether it reads the packed panels)."""
    out = {"kernel 8-lane": (jax.jit(functools.partial(kernels.matmul, wide=False)), True)}
    if wide:
        out["kernel 16-lane"] = (jax.jit(functools.partial(kernels.matmul, wide=True)), True)
    out["XLA bf16"] = (jax.jit(kernels.xla_matmul), False)
    out["XLA fp32"] = (jax.jit(functools.partial(kernels.xla_matmul, f32=True)), False)
    return out


def jax_call(run, x, w):
    return lambda: run(x, w).block_until_ready()


def torch_products(x, plain) -> dict:
    """name -> a call of PyTorch's product of the same operands, float32 and bfloat16."""
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    x32, w32 = torch.from_numpy(np.array(x)), torch.from_numpy(np.array(plain, np.float32))
    x16, w16 = x32.to(torch.bfloat16), w32.to(torch.bfloat16)
    return {"torch fp32": lambda: torch.mm(x32, w32), "torch bf16": lambda: torch.mm(x16, w16)}


def time_once(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="32,128,512,2048", help="comma-separated row counts")
    parser.add_argument("--shapes", default=SMOLLM2, help="comma-separated in x out products")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--reference", action="store_true", help="add PyTorch's products (oneDNN / MKL)")
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit("the CPU kernels are not available here (needs x86 with AVX2 + FMA and g++)")
    runs = paths(kernels.wide_vectors())
    names = list(runs) + (["torch fp32", "torch bf16"] if args.reference else [])
    print("rows x in x out | " + " | ".join(names) + "   (ms, median; GFLOP/s)")
    for rows in (int(r) for r in args.rows.split(",")):
        for shape in args.shapes.split(","):
            depth, width = (int(s) for s in shape.split("x"))
            x = jnp.ones((rows, depth), jnp.float32)
            packed = jnp.full((width // kernels.PANEL, depth, kernels.PANEL), 0.01, jnp.bfloat16)
            plain = jnp.full((depth, width), 0.01, jnp.bfloat16)
            calls = {name: jax_call(run, x, packed if reads_panels else plain)
                     for name, (run, reads_panels) in runs.items()}
            if args.reference:
                calls.update(torch_products(x, plain))
            for call in calls.values():
                call()  # compile / warm up
            times = {name: [] for name in calls}
            for _ in range(args.repeats):
                for name, call in calls.items():
                    times[name].append(time_once(call))
            flops = 2 * rows * depth * width
            cells = [f"{1e3 * statistics.median(t):8.2f} ({flops / statistics.median(t) / 1e9:4.0f})"
                     for t in times.values()]
            print(f"{rows:5d} x {depth:5d} x {width:5d} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
