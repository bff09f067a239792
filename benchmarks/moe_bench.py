"""The experts of one mixture-of-experts layer on this machine: time per call of each dispatch in
engine.layers.moe over a step's tokens, at a model's sizes (default: a Qwen3-MoE of ~1B total /
~0.2B active parameters: 1024 wide, 64 experts of 384, 8 a token).

    python -m benchmarks.moe_bench --tokens 1 8 64 256 --repeats 20

grouped: `dispatch` (grouped products; XLA on CPUs runs each as a product over every expert);
tiled: `dispatch_tiled` (a loop over tiles of 8 rows, each through its own expert alone), the
weights as `for_platform(..., "cpu")` holds them.
Prints the median milliseconds per call and the weight bytes an ideal step reads (each chosen
expert once)."""

from __future__ import annotations

import argparse
import statistics
import time

import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp

from engine.layers.moe import MoE, Routing, dispatch, dispatch_tiled, for_platform


def median_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--expert-mlp", type=int, default=384)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    Embed, Experts = hax.Axis("embed", args.hidden), hax.Axis("experts", args.experts)
    moe = MoE.init(Embed, Experts, hax.Axis("expert_mlp", args.expert_mlp), Routing(args.top_k), hnn.silu,
                   key=jax.random.PRNGKey(0))
    moe = jax.tree_util.tree_map(lambda a: a.astype(args.dtype) if eqx_array(a) else a, moe)
    expert_bytes = 3 * args.hidden * args.expert_mlp * jnp.dtype(args.dtype).itemsize
    print(f"{jax.devices()[0].device_kind}, {args.experts} experts of {args.hidden} x {args.expert_mlp}, top "
          f"{args.top_k}, {args.dtype}; ms per layer call (median of {args.repeats})")
    print(f"{'tokens':>6} {'distinct':>8} {'ideal MB':>8} {'grouped':>8} {'tiled':>8}")
    for tokens in args.tokens:
        Pos = hax.Axis("position", tokens)
        x = hax.random.normal(jax.random.PRNGKey(tokens), (Pos, Embed)).astype(args.dtype)
        weights, chosen = moe.routing.choose(moe.gate(x))
        distinct = len(set(chosen.array.reshape(-1).tolist()))
        on_cpu = for_platform(moe, "cpu").experts  # bfloat16 weights held as bits
        timings = [median_ms(jax.jit(dispatch), x, weights, chosen, moe.experts, repeats=args.repeats),
                   median_ms(jax.jit(dispatch_tiled), x, weights, chosen, on_cpu, repeats=args.repeats)]
        print(f"{tokens:>6} {distinct:>8} {distinct * expert_bytes / 1e6:>8.1f} " +
              " ".join(f"{t:>8.2f}" for t in timings))


def eqx_array(leaf) -> bool:
    return isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.floating)


if __name__ == "__main__":
    main()
