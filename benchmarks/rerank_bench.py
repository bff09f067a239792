"""Rerank benchmark: the latency of one rerank of `--documents` documents, the score engine against
transformers' forward on the same cross-encoder.

    .venv/bin/python -m benchmarks.rerank_bench --documents 100 --rounds 7

Work: a random BERT cross-encoder the size of ms-marco-MiniLM-L-12-v2 (12 layers, 384 wide, 12
heads, MLP 1,536, 30,522-token vocabulary; made once under ~/.cache/jax-serve/bench-cross-encoder),
float32 (ours also in bfloat16: `--dtype`). One query of `--query-len` token ids against
`--documents` documents of `--doc-len` ids each, as the tokenizer's pair encoding lays them out
([CLS] query [SEP] document [SEP], token types 0 then 1): token ids in, scores out, no tokenizer on
either side. Ours: `ScoreEngine.score` over the pairs (its buckets, cut by
`--max-num-batched-tokens`); transformers: `BertForSequenceClassification` over all pairs in one
padded batch under `torch.no_grad()`, then the sigmoid. Each figure is the median over `--rounds`
rounds, the two interleaved in each round; our buckets compile and an untimed round warms both
first. The scores are checked to agree (1e-4; 2e-2 in bfloat16) before any timing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from engine.config import EngineConfig
from engine.score.driver import Pair
from engine.score.engine import ScoreEngine

CHECKPOINT = Path.home() / ".cache/jax-serve/bench-cross-encoder"
SIZES = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=12, num_attention_heads=12, intermediate_size=1536,
             max_position_embeddings=512, num_labels=1)


def cross_encoder(path: Path) -> Path:
    """A random BERT cross-encoder of SIZES, made on first use."""
    if not (path / "config.json").is_file():
        import torch
        import transformers

        torch.manual_seed(0)
        transformers.BertForSequenceClassification(transformers.BertConfig(**SIZES)).save_pretrained(path)
    return path


def make_pairs(documents: int, query_len: int, doc_len: int, seed: int = 0) -> list[Pair]:
    """[CLS] query [SEP] document [SEP] as ids, the query shared, the documents random."""
    rng = np.random.default_rng(seed)
    query = rng.integers(1000, SIZES["vocab_size"], query_len).tolist()
    cls, sep = 101, 102
    return [Pair([cls, *query, sep, *rng.integers(1000, SIZES["vocab_size"], doc_len).tolist(), sep], query_len + 2)
            for _ in range(documents)]


def torch_scorer(path: Path, pairs: list[Pair]):
    """A function that scores `pairs` with transformers in one batch (ids and types made once)."""
    import torch
    import transformers

    model = transformers.BertForSequenceClassification.from_pretrained(path).eval()
    length = max(len(p.token_ids) for p in pairs)
    ids, types, mask = (torch.zeros((len(pairs), length), dtype=torch.long) for _ in range(3))
    for row, pair in enumerate(pairs):
        n = len(pair.token_ids)
        ids[row, :n], types[row, pair.first_segment:n], mask[row, :n] = torch.tensor(pair.token_ids), 1, 1

    def score() -> np.ndarray:
        with torch.no_grad():
            logits = model(input_ids=ids, token_type_ids=types, attention_mask=mask).logits
        return torch.sigmoid(logits[:, 0]).numpy()

    return score


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=100)
    parser.add_argument("--query-len", type=int, default=16)
    parser.add_argument("--doc-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="ours (transformers runs float32)")
    args = parser.parse_args(argv)
    path = cross_encoder(CHECKPOINT)
    pairs = make_pairs(args.documents, args.query_len, args.doc_len)
    engine = ScoreEngine(EngineConfig(model=str(path), dtype=args.dtype, max_num_seqs=args.documents,
                                      max_model_len=args.query_len + args.doc_len + 3,
                                      max_num_batched_tokens=args.max_num_batched_tokens))
    while engine.compile_progress()[0] < engine.compile_progress()[1]:  # every bucket, not the first alone
        time.sleep(0.5)
    reference = torch_scorer(path, pairs)
    ours_scores, torch_scores = engine.score(pairs), reference()  # warms
    np.testing.assert_allclose(ours_scores, torch_scores, atol=1e-4 if args.dtype == "float32" else 2e-2)
    ours, theirs = [], []
    for _ in range(args.rounds):
        ours.append(timed(lambda: engine.score(pairs)))
        theirs.append(timed(reference))
    tokens = sum(len(p.token_ids) for p in pairs)
    print(f"| system | rerank of {args.documents} documents ({tokens} tokens), median ms | best ms |")
    print("|---|---:|---:|")
    print(f"| jax-serve ScoreEngine ({args.dtype}) | {1e3 * statistics.median(ours):.1f} | {1e3 * min(ours):.1f} |")
    print(f"| transformers {'BertForSequenceClassification'} (float32, torch) | "
          f"{1e3 * statistics.median(theirs):.1f} | {1e3 * min(theirs):.1f} |")


if __name__ == "__main__":
    main()
