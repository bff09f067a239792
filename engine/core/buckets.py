"""Shape buckets: the few step shapes XLA compiles, and which one a step takes. Pure Python.

One token layout for every backend: rows packed one after another (decodes first), each row's
tokens contiguous, padding only at the step's end. A step's arrays have fixed shapes so that each
shape compiles once: a bucket is `T` token slots from a short ladder (1, then powers of two from 8
up to the step's token budget, the budget itself last) and `R = min(T, max_num_seqs)` row slots
(a row is one sequence's tokens; it samples at most one token). No page dimension: every row's
page table spans `max_model_len`, and every backend reads only the pages a row's length covers.

The leader picks the bucket (every host of a replica must run the same shapes) and the step plan
carries it. While programs still compile in the background, a step takes the smallest *ready*
bucket that holds it (`for_step(..., ready=...)`), and the scheduler is given the largest ready
bucket's tokens and rows as its limits (`Bucket.tokens`, `Bucket.rows`).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional


def pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


SMALLEST_BATCH = 8
"""The ladder's first rung above 1: steps of 2..8 tokens share one program (decoding a handful of
sequences costs about what decoding one does: the weights are read once either way)."""


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    """The static shapes of one step."""

    tokens: int
    """T: token slots of the step."""
    rows: int
    """R: row slots of the step (R <= T: every row has at least one token)."""


@dataclasses.dataclass(frozen=True)
class ShapeBuckets:
    """The bucket ladder of one engine; see the module docstring."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_pages_per_seq: int
    page_size: int

    @property
    def max_rows(self) -> int:
        """Rows of a step at most (each running sequence has at most one row): the length of
        every step's sampled-token array."""
        return self.max_num_seqs

    @property
    def token_ladder(self) -> list[int]:
        budget = self.max_num_batched_tokens
        rungs = {1, budget}
        rungs.update(1 << k for k in range(SMALLEST_BATCH.bit_length() - 1, budget.bit_length()) if 1 << k < budget)
        return sorted(rungs)

    def bucket(self, tokens: int) -> Bucket:
        return Bucket(tokens, min(tokens, self.max_rows))

    def all(self) -> list[Bucket]:
        """Every bucket a step can take, smallest first."""
        return [self.bucket(t) for t in self.token_ladder]

    def compile_order(self) -> list[Bucket]:
        """Every bucket, in the order a replica compiles them: first the one a full batch of
        decodes fits (with it alone the replica serves everything, prompts in pieces of its size),
        then the rest smallest first. A function of the config alone: every host agrees."""
        first = self.for_step(min(self.max_num_seqs, self.max_num_batched_tokens), 1)
        return [first] + [b for b in self.all() if b != first]

    def for_step(self, num_tokens: int, num_rows: int, ready: Optional[Iterable[Bucket]] = None) -> Bucket:
        """The smallest bucket (of `ready`, default all) holding `num_tokens` tokens in `num_rows` rows."""
        candidates = self.all() if ready is None else sorted(ready)
        for bucket in candidates:
            if bucket.tokens >= num_tokens and bucket.rows >= num_rows:
                return bucket
        raise ValueError(f"no compiled bucket holds a step of {num_tokens} tokens in {num_rows} rows "
                         f"(have {candidates}); the scheduler must keep steps within the largest (engine bug)")
