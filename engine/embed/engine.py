"""The embedding engine: token id lists in, one float32 vector per list out (`/v1/embeddings`).

    EmbeddingEngine(config).embed([[101, 7592, 102], [101, 102]]) -> np.ndarray [2, dimensions]

A sentence-transformers checkpoint (engine.models.sentence_transformer: BERT, XLM-RoBERTa,
EmbeddingGemma, Qwen3-Embedding; or a plain checkpoint of those families) on one device. A batch is
sorted by length and cut into groups, each padded into a shape bucket (`EmbedBuckets`: powers of
two of rows and of positions) that compiles once, where the cuts waste the least padding; padding
is masked, so a row's embedding does not depend on its batch. All groups of a call are dispatched
before any result is read back. With `warmup`, the one-row program of the longest length compiles
before the engine returns and the rest in the background (engine.compiler); until they are
in, a batch is laid over the ready buckets only.

Of `EngineConfig` it reads `model`, `dtype`, `max_model_len` (None: sentence_bert_config.json's
max_seq_length, else the positions the model numbers), `max_num_seqs` (rows per program),
`max_num_batched_tokens` (padded tokens per program, beyond one row of max_model_len), `warmup`
and `compilation_cache_dir`. The caller never touches jax: numpy in and out. Not thread-safe
except `validate`; engine.embed.driver runs it on one thread.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import jax
import numpy as np

from engine.compiler import StepCompiler
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.ladder import ladder
from engine.models import sentence_transformer
from engine.one_device import OneDeviceEngine

MIN_LENGTH_BUCKET = 16
"""The shortest padded length compiled: shorter ones would save little and add programs."""
CALL_OVERHEAD_TOKENS = 32
"""What one more program costs beyond its tokens, in padded tokens' worth of work: a batch is split
where that saves more padding than this."""


@dataclasses.dataclass(frozen=True)
class EmbedBuckets:
    """The padded shapes (rows, length) the engine compiles, and how a batch is laid over them.

    Lengths are powers of two from MIN_LENGTH_BUCKET up to `max_len`, then `max_len` itself. A
    length's rows are powers of two up to its cap, then the cap: `max_rows`, or fewer so that
    rows x length stays within `max_tokens` (always at least one row).
    """

    max_rows: int
    max_len: int
    max_tokens: int

    def lengths(self) -> list[int]:
        return ladder(min(MIN_LENGTH_BUCKET, self.max_len), self.max_len)

    def row_cap(self, length: int) -> int:
        return max(1, min(self.max_rows, self.max_tokens // length))

    def all(self) -> list[tuple[int, int]]:
        """Every (rows, length) bucket."""
        return [(rows, length) for length in self.lengths() for rows in ladder(1, self.row_cap(length))]

    def compile_order(self) -> list[tuple[int, int]]:
        """Every bucket in the order a replica compiles them: first one row of the longest length
        (with it alone any batch runs, an input per call), then the rest, cheapest first."""
        first = (1, self.max_len)
        return [first] + sorted((b for b in self.all() if b != first), key=lambda b: (b[0] * b[1], b))

    def length_bucket(self, n: int, lengths: Optional[Iterable[int]] = None) -> int:
        """The shortest length bucket (of `lengths`, default all) that holds n tokens."""
        return next(length for length in sorted(lengths or self.lengths()) if length >= n)

    def plan(self, lengths: list[int],
             ready: Optional[Iterable[tuple[int, int]]] = None) -> list[tuple[int, int, list[int]]]:
        """Groups of input indices with their bucket (rows, length) of `ready` (default: all), the
        cheapest cover of the inputs: sorted by length and cut into runs so that the padded tokens
        computed, plus CALL_OVERHEAD_TOKENS per program, are fewest (dynamic programming over the
        cuts, at most len(lengths) x max_rows steps). Every length is at most `max_len`, and
        `ready` holds (1, max_len)."""
        rows_of: dict[int, list[int]] = {}  # length bucket -> its row buckets
        for rows, length in self.all() if ready is None else ready:
            rows_of.setdefault(length, []).append(rows)
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        fits: dict[int, list[int]] = {}  # length bucket -> rows bucket for each run size
        best, cut = [0.0] + [float("inf")] * len(order), [0] * (len(order) + 1)
        for end in range(1, len(order) + 1):
            length = self.length_bucket(lengths[order[end - 1]], rows_of)
            if length not in fits:
                fits[length] = self._rows_fitting(sorted(rows_of[length]))
            fit = fits[length]
            for size in range(1, min(end, len(fit) - 1) + 1):
                cost = best[end - size] + CALL_OVERHEAD_TOKENS + fit[size] * length
                if cost < best[end]:
                    best[end], cut[end] = cost, end - size
        groups, end = [], len(order)
        while end:
            groups.append(order[cut[end]:end])
            end = cut[end]
        return [self._bucket_of(group, lengths, rows_of, fits) for group in reversed(groups)]

    @staticmethod
    def _rows_fitting(rows: list[int]) -> list[int]:
        """[_, rows bucket for 1 input, for 2 inputs, ..., for the most inputs], of the sorted `rows`."""
        return [0] + [next(r for r in rows if r >= size) for size in range(1, rows[-1] + 1)]

    def _bucket_of(self, group: list[int], lengths: list[int], rows_of, fits) -> tuple[int, int, list[int]]:
        length = self.length_bucket(max(lengths[i] for i in group), rows_of)
        return fits[length][len(group)], length, group


class EmbeddingEngine(OneDeviceEngine):
    """A sentence encoder and its compiled buckets. `embed` and `validate` are the whole API."""

    task = "embedding"
    programs_key = "buckets"

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.config = config
        checkpoint = sentence_transformer.read_checkpoint(config.model)
        model_config = checkpoint.config
        self.pooling = checkpoint.pooling
        self.dtype = model_config.dtype if config.dtype == "auto" else config.dtype
        self.max_model_len = config.max_model_len or checkpoint.max_seq_length or model_config.max_positions
        if self.max_model_len > model_config.max_positions:
            offset = model_config.max_position_embeddings - model_config.max_positions
            less = f" less its position offset {offset}" if offset else ""
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                             f"{model_config.max_position_embeddings}{less}; lower max_model_len")
        self.vocab_size = model_config.vocab_size
        self.dimensions = checkpoint.dimensions
        self.max_batch_size = config.max_num_seqs
        """Rows of one compiled program; AsyncEmbedder merges callers up to this many inputs."""
        self.buckets = EmbedBuckets(config.max_num_seqs, self.max_model_len, config.max_num_batched_tokens)
        model = sentence_transformer.load_model(checkpoint, self.dtype)
        # the model travels as its flat list of arrays: flattening equinox modules per call is slow
        self._weights, treedef = jax.tree_util.tree_flatten(model)

        @jax.jit
        def program(weights, tokens, mask):
            return sentence_transformer.embed(jax.tree_util.tree_unflatten(treedef, weights), tokens, mask)

        self._program = program
        self.compiler = StepCompiler(self.buckets.compile_order(), self._compile, lambda b: f"({b[0]} rows x {b[1]})")
        self._ready(config.warmup)

    def validate(self, token_ids_batch: list[list[int]]) -> None:
        """Raise InvalidRequestError (param "input") unless every list can be embedded. Thread-safe."""
        if not token_ids_batch:
            raise InvalidRequestError("the input is empty; send at least one text or token list", "input")
        for i, ids in enumerate(token_ids_batch):
            if not ids:
                raise InvalidRequestError(f"input[{i}] has no tokens; send at least one token per input", "input")
            if len(ids) > self.max_model_len:
                raise InvalidRequestError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, input[{i}] "
                    f"has {len(ids)} tokens. Please reduce the length of the input.", "input")
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"input[{i}] names token id {bad}, outside the vocabulary [0, {self.vocab_size})", "input")

    def embed(self, batch: list[list[int]]) -> np.ndarray:
        """float32 [len(batch), dimensions], row i the embedding of batch[i] (validated first)."""
        self.validate(batch)
        lengths = [len(ids) for ids in batch]
        launched = []
        for rows, length, group in self.buckets.plan(lengths, self.compiler.ready()):  # while compiling: the ready ones
            tokens = np.zeros((rows, length), np.int32)
            mask = np.zeros((rows, length), bool)
            for row, index in enumerate(group):
                tokens[row, : lengths[index]] = batch[index]
                mask[row, : lengths[index]] = True
            launched.append((group, self._program(self._weights, tokens, mask)))  # dispatch, do not wait
        out = np.empty((len(batch), self.dimensions), np.float32)
        for group, result in launched:
            out[group] = np.asarray(result)[: len(group)]
        return out

    def _compile(self, bucket: tuple[int, int]) -> None:
        """Compile one bucket's program without running it (fills jit's cache for `embed`)."""
        rows, length = bucket
        self._program.lower(self._weights, np.zeros((rows, length), np.int32), np.ones((rows, length), bool)).compile()

    def _facts(self) -> dict[str, str]:
        return {
            "pooling": "+".join(self.pooling.modes),
            "normalize": str(self.pooling.normalize).lower(),
            "dimensions": str(self.dimensions),
            "max_model_len": str(self.max_model_len),
            "max_batch_size": str(self.max_batch_size),
        }
