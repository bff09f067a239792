"""The CPU attention kernel on one prompt's causal attention, one layer.

    .venv/bin/python -m benchmarks.attention_bench --tokens 128,512,2000
    PYTHONPATH=/tmp/base .venv/bin/python -m benchmarks.attention_bench   # another checkout's kernel

One row of S prompt tokens (query s sees tokens [0, s]) over a bfloat16 page pool in a shuffled
page order, SmolLM2's attention shape by default (3 KV heads x 3 query heads, head size 64, pages
of 16). Both vector widths (where the CPU has AVX-512) are compiled in one process and timed
alternately; prints the median of `--repeats` runs and the FLOP rate of the causal products
(4 * heads * head size * S (S + 1) / 2). `--reference` adds PyTorch's causal
`scaled_dot_product_attention` (its CPU flash kernel) over the same keys and values in float32,
contiguous, one per query head, on as many threads as this process may use.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from engine.backends.cpu import kernels


def inputs(tokens: int, kv_heads: int, group: int, dim: int, page_size: int, seed: int = 0):
    """q, the key and value pools, page tables, rows and lengths for one causal prompt."""
    rng = np.random.default_rng(seed)
    pages = -(-tokens // page_size)
    order = rng.permutation(np.arange(1, pages + 1)).astype(np.int32)[None]  # page 0 stays unused
    k = jnp.asarray(rng.standard_normal((1, pages + 1, kv_heads, dim, page_size)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((1, pages + 1, kv_heads, page_size, dim)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((tokens, kv_heads, group, dim)) * 0.1, jnp.float32)
    rows = jnp.zeros(tokens, jnp.int32)
    lens = jnp.arange(1, tokens + 1, dtype=jnp.int32)
    return q, k, v, jnp.asarray(order), rows, lens


def torch_attention(q, k, v, pages):
    """A call of PyTorch's causal attention over the row's keys and values in token order."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    tokens, kv_heads, group, dim = q.shape
    order = np.asarray(pages[0])

    def contiguous(pool, page_axis_last):  # [pages, kv_heads, ...] -> [1, heads, tokens, dim], one per query head
        x = np.asarray(pool[0, order], np.float32)
        x = x.transpose(1, 0, 3, 2) if page_axis_last else x.transpose(1, 0, 2, 3)
        x = x.reshape(kv_heads, -1, dim)[:, :tokens]
        return torch.from_numpy(np.repeat(x, group, axis=0)[None].copy())

    keys, values = contiguous(k, True), contiguous(v, False)
    queries = torch.from_numpy(np.array(q).reshape(tokens, kv_heads * group, dim).transpose(1, 0, 2)[None].copy())
    return lambda: F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=1.0)  # q is pre-scaled


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="128,512,2000")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--reference", action="store_true", help="add PyTorch's scaled_dot_product_attention")
    args = parser.parse_args(argv)
    if not kernels.available():
        raise SystemExit("the CPU kernels are not available here (needs a CPU backend with AVX2 + FMA)")
    widths = [False, True] if kernels.wide_vectors() else [False]
    attend = jax.jit(kernels.paged_attention, static_argnames="wide")
    names = [f"{16 if w else 8}-lane" for w in widths] + (["torch SDPA fp32"] if args.reference else [])
    print("| tokens | " + " | ".join(f"{name} ms (GFLOP/s)" for name in names) + " |")
    print("|---|" + "---|" * len(names))
    for tokens in (int(t) for t in args.tokens.split(",")):
        q, k, v, pages, rows, lens = inputs(tokens, args.kv_heads, args.group, args.dim, args.page_size)
        calls = {name: (lambda w=w: attend(q, k, v, 0, pages, rows, lens, wide=w).block_until_ready())
                 for name, w in zip(names, widths)}
        if args.reference:
            calls["torch SDPA fp32"] = torch_attention(q, k, v, pages)
        for call in calls.values():
            call()  # compile / warm up
        times = {name: [] for name in calls}
        for _ in range(args.repeats):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
        flops = 4 * args.kv_heads * args.group * args.dim * tokens * (tokens + 1) / 2
        cells = []
        for samples in times.values():
            seconds = statistics.median(samples)
            cells.append(f"{seconds * 1e3:.2f} ({flops / seconds / 1e9:.0f})")
        print(f"| {tokens} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
