"""The score engine: (query, document) pairs in, one float32 relevance score a pair out (`/v1/rerank`,
`/v1/score`).

    ScoreEngine(config).score([Pair([101, 7, 102, 9, 102], 3)]) -> np.ndarray [1]

A BERT or XLM-RoBERTa cross-encoder, or a decoder reranker (engine.models.classifier), on one
device. Batches are laid over the embedding engine's shape buckets (engine.embed.engine.EmbedBuckets:
padded rows x positions, each compiled once, cut where padding is least), padding masked, so a
pair's score does not depend on its batch; every group of a call is dispatched before any result is
read back. With `warmup`, the one-row program of the longest length compiles before the engine
returns, the rest in the background.

It speaks engine.embed.driver's protocol over packed pairs (engine.score.driver: `validate` and
`embed` take rows `[first_segment_length, *token_ids]`, `embed` returns [rows, 1]), so
engine.score.driver.AsyncScorer batches it across callers. Of `EngineConfig` it reads what the
embedding engine reads; `max_model_len` defaults to the positions the model numbers. Not
thread-safe except `validate`.
"""

from __future__ import annotations

import jax
import numpy as np

from engine.compiler import StepCompiler
from engine.config import EngineConfig
from engine.embed.engine import EmbedBuckets
from engine.errors import InvalidRequestError
from engine.models import classifier
from engine.one_device import OneDeviceEngine
from engine.score.driver import Pair, unpack


class ScoreEngine(OneDeviceEngine):
    """A cross-encoder and its compiled buckets. `score`, `embed` (packed rows) and `validate` are the API."""

    task = "score"
    programs_key = "buckets"

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        checkpoint = classifier.read_checkpoint(config.model)
        model_config = checkpoint.config
        self.activation = checkpoint.activation
        self.kind = "decoder reranker" if checkpoint.is_decoder else "cross-encoder"
        """What the replica encodes pairs for: "cross-encoder" (the tokenizer's pair encoding) or
        "decoder reranker" (the reranker's prompt template)."""
        self.type_vocab_size = checkpoint.type_vocab_size
        self.dtype = model_config.dtype if config.dtype == "auto" else config.dtype
        self.max_model_len = config.max_model_len or model_config.max_positions
        if self.max_model_len > model_config.max_positions:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the {model_config.max_positions} positions "
                             "the model numbers; lower max_model_len")
        self.vocab_size = model_config.vocab_size
        self.dimensions = 1
        """One score a row (the embedding driver's protocol)."""
        self.max_batch_size = config.max_num_seqs
        self.buckets = EmbedBuckets(config.max_num_seqs, self.max_model_len, config.max_num_batched_tokens)
        model = classifier.load_scorer(checkpoint, self.dtype)
        # the model travels as its flat list of arrays: flattening equinox modules per call is slow
        self._weights, treedef = jax.tree_util.tree_flatten(model)

        @jax.jit
        def program(weights, tokens, types, mask):
            return classifier.score(jax.tree_util.tree_unflatten(treedef, weights), tokens, types, mask)

        self._program = program
        self.compiler = StepCompiler(self.buckets.compile_order(), self._compile, lambda b: f"({b[0]} rows x {b[1]})")
        self._ready(config.warmup)

    def validate(self, rows: list[list[int]]) -> None:
        """Raise InvalidRequestError (param "input") unless every packed pair can be scored. Thread-safe."""
        if not rows:
            raise InvalidRequestError("there are no pairs to score; send at least one", "input")
        for i, row in enumerate(rows):
            pair = unpack(row)
            if not pair.token_ids or not 0 <= pair.first_segment <= len(pair.token_ids):
                raise InvalidRequestError(f"pair {i} has no tokens or a first segment outside them", "input")
            if len(pair.token_ids) > self.max_model_len:
                raise InvalidRequestError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, pair {i} has "
                    f"{len(pair.token_ids)} tokens. Please reduce the length of the input.", "input")
            bad = next((t for t in pair.token_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"pair {i} names token id {bad}, outside the vocabulary [0, {self.vocab_size})", "input")

    def score(self, pairs: list[Pair]) -> np.ndarray:
        """float32 [len(pairs)], each pair's score (validated first)."""
        return self.embed([pair.packed() for pair in pairs])[:, 0]

    def embed(self, rows: list[list[int]]) -> np.ndarray:
        """float32 [len(rows), 1]: the score of each packed pair (validated first)."""
        self.validate(rows)
        pairs = [unpack(row) for row in rows]
        lengths = [len(p.token_ids) for p in pairs]
        launched = []
        for n, length, group in self.buckets.plan(lengths, self.compiler.ready()):  # while compiling: the ready ones
            tokens, types = np.zeros((n, length), np.int32), np.zeros((n, length), np.int32)
            mask = np.zeros((n, length), bool)
            for row, index in enumerate(group):
                pair = pairs[index]
                tokens[row, : lengths[index]] = pair.token_ids
                if self.type_vocab_size > 1:
                    types[row, pair.first_segment: lengths[index]] = 1
                mask[row, : lengths[index]] = True
            launched.append((group, self._program(self._weights, tokens, types, mask)))  # dispatch, do not wait
        out = np.empty((len(rows), 1), np.float32)
        for group, result in launched:
            out[group, 0] = np.asarray(result)[: len(group)]
        return out

    def _compile(self, bucket: tuple[int, int]) -> None:
        """Compile one bucket's program without running it (fills jit's cache for `embed`)."""
        n, length = bucket
        ints = np.zeros((n, length), np.int32)
        self._program.lower(self._weights, ints, ints, np.ones((n, length), bool)).compile()

    def _facts(self) -> dict[str, str]:
        return {
            "kind": self.kind,
            "activation": self.activation,
            "max_model_len": str(self.max_model_len),
            "max_batch_size": str(self.max_batch_size),
        }
