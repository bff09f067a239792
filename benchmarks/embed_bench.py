"""Embedding benchmark: sentences/s of the EmbeddingEngine, next to sentence-transformers when importable.

    .venv/bin/python -m benchmarks.embed_bench --model all-minilm-l6-v2 --batch 1,64

Work: `--sentences` fixed English-like sentences (4 to 30 words, the same every round) embedded in
calls of `batch` sentences, text in and vectors out: our rows tokenize with the checkpoint's fast
tokenizer and then call `EmbeddingEngine.embed` (the "engine only" row times `embed` alone, on ids
tokenized beforehand); sentence-transformers' `encode(batch_size=batch)` tokenizes inside. Each
figure is the median over `--rounds` rounds (and the best round beside it: on a shared host, torch's
OpenMP threads slow down many times over whenever another process takes a core, XLA's far less), the
systems interleaved within a round so the host's drift hits both alike. Compilation is excluded: an
untimed round first compiles the buckets used (and warms torch's per-shape kernels).

sentence-transformers is not a project dependency; to compare, install it beside the venv for the
measurement only (its 5.1 line is the last for transformers 4.x):

    .venv/bin/pip install --no-deps --target /tmp/st "sentence-transformers<5.2" scikit-learn==1.5.2 \\
        joblib==1.4.2 threadpoolctl
    PYTHONPATH=/tmp/st .venv/bin/python -m benchmarks.embed_bench
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Callable

import numpy as np

from engine.config import EngineConfig
from engine.embed.engine import EmbeddingEngine
from engine.formats.model_sources import resolve_model

_WORDS = ("the a city river capital France Paris yellow banana engine model server token vector quickly "
          "small large old new because while after before people language computer science music history "
          "market price water mountain school teacher student book reads writes runs builds finds measures "
          "is are was were has have with without from into over under near far every some many few").split()


def make_sentences(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(_WORDS, size=rng.integers(4, 31))).capitalize() + "." for _ in range(count)]


def time_round(run: Callable[[list], object], items: list, batch: int) -> float:
    """Seconds to run `run` over `items` in calls of `batch`."""
    start = time.perf_counter()
    for i in range(0, len(items), batch):
        run(items[i: i + batch])
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="all-minilm-l6-v2", help="checkpoint directory or builtin alias")
    parser.add_argument("--batch", default="1,64", help="sentences per call, comma-separated")
    parser.add_argument("--sentences", type=int, default=128, help="sentences per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--no-sentence-transformers", action="store_true", help="skip the comparison")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    batches = [int(b) for b in args.batch.split(",")]

    from transformers import AutoTokenizer

    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = EmbeddingEngine(EngineConfig(model=str(model_dir), dtype=args.dtype, max_num_seqs=max(batches),
                                          max_num_batched_tokens=max(batches) * 64, warmup=False))
    sentences = make_sentences(args.sentences)
    ids = [tokenizer(s, truncation=True, max_length=engine.max_model_len)["input_ids"] for s in sentences]
    systems: dict[str, tuple[Callable, list]] = {
        "jax-serve (tokenize + embed)": (lambda chunk: engine.embed(tokenizer(chunk, truncation=True,
                                         max_length=engine.max_model_len)["input_ids"]), sentences),
        "jax-serve (embed only)": (engine.embed, ids),
    }
    st_model = None if args.no_sentence_transformers else _sentence_transformer(model_dir)
    if st_model is not None:
        systems["sentence-transformers"] = (lambda chunk: st_model.encode(chunk, batch_size=len(chunk)), sentences)

    times: dict[tuple[str, int], list[float]] = {(name, b): [] for name in systems for b in batches}
    for round_ in range(args.rounds + 1):  # round 0 compiles and warms caches, untimed
        for batch in batches:
            for name, (run, items) in systems.items():
                seconds = time_round(run, items, batch)
                if round_:
                    times[name, batch].append(seconds)

    tokens = sum(len(i) for i in ids)
    print(f"model {model_dir.name} ({engine.describe()}), {args.sentences} sentences of "
          f"{tokens / len(ids):.1f} tokens on average, medians of {args.rounds} rounds")
    if st_model is not None:
        want = st_model.encode(sentences[:64])
        got = engine.embed(ids[:64])
        cosine = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
        print(f"agreement with sentence-transformers: min cosine {cosine.min():.6f}, "
              f"max abs diff {np.abs(got - want).max():.2e}")
    print("| system | batch | sentences/s (median) | best round | ms per call (median) |\n|---|---|---|---|---|")
    for (name, batch), runs in times.items():
        seconds = statistics.median(runs)
        calls = -(-args.sentences // batch)
        print(f"| {name} | {batch} | {args.sentences / seconds:.0f} | {args.sentences / min(runs):.0f} | "
              f"{1000 * seconds / calls:.1f} |")


def _sentence_transformer(model_dir):
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("sentence-transformers is not importable: comparing nothing (see this script's docstring)")
        return None
    return SentenceTransformer(str(model_dir), device="cpu")


if __name__ == "__main__":
    main()
