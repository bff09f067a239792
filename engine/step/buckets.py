"""Shape buckets: the few step shapes XLA compiles, and which one a step takes. Pure Python.

One token layout for every backend: rows packed one after another (decodes first), each row's
tokens contiguous, padding only at the step's end. A step's arrays have fixed shapes so that each
shape compiles once. A step's bucket is two sizes, each from a short ladder:

- `T` token slots (1, then powers of two from 8 up to the step's token budget, the budget itself
  last): the forward program's size. Its per-row arrays (page tables, lengths) always have
  `max_num_seqs` rows, so the forward program depends on T alone. No page dimension either: every
  row's page table spans `max_model_len`, and every backend reads only the pages a row's length
  covers.
- `R` sampling slots that the LM head and the sampler run on (a row is one sequence's tokens and
  samples one token, or 1 + its guesses with speculative decoding; R covers the step's samples):
  the sizes min(T, max_samples) of the token ladder, so a long prompt's step computes one row of
  logits, not max_num_seqs.

`all()` lists the compile units, Bucket(T, min(T, max_samples)) for each T: a forward program
and the sampler programs for its R. The leader picks each step's bucket (every host of a replica
must run the same shapes) and the step plan carries it. While programs still compile in the
background, a step takes the smallest T and R that are ready (`for_step(..., ready=...)`), and the
scheduler gets the largest ready T as its token limit.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

from engine.ladder import ladder


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
    """T: token slots of the step (the forward program's size)."""
    samples: int
    """R: sampling slots the LM head and the sampler run on (at least the step's samples). Not
    rows: a step's per-row arrays always have `ShapeBuckets.max_rows` rows."""


@dataclasses.dataclass(frozen=True)
class ShapeBuckets:
    """The bucket ladder of one engine; see the module docstring."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_pages_per_seq: int
    page_size: int
    max_drafts: int = 0
    """Guessed tokens a row may carry (speculative decoding; 0: none)."""

    @property
    def max_rows(self) -> int:
        """Rows of a step at most (each running sequence has at most one row): the length of every
        step's per-row arrays."""
        return self.max_num_seqs

    @property
    def max_samples(self) -> int:
        """Sampling slots of a step at most (one per row, and one per guess): the length of its
        sampled-token array."""
        return self.max_num_seqs * (1 + self.max_drafts)

    @property
    def token_ladder(self) -> list[int]:
        """1, then SMALLEST_BATCH, twice that, ... below the token budget, then the budget."""
        return sorted({1, *ladder(SMALLEST_BATCH, self.max_num_batched_tokens)})

    def bucket(self, tokens: int) -> Bucket:
        return Bucket(tokens, min(tokens, self.max_samples))

    def all(self) -> list[Bucket]:
        """The compile units, smallest first: each T of the ladder with R = min(T, max_samples)."""
        return [self.bucket(t) for t in self.token_ladder]

    def compile_order(self) -> list[Bucket]:
        """Every bucket, in the order a replica compiles them: first the one a full batch of
        decodes fits (with it alone the replica serves everything, prompts in pieces of its size),
        then the rest smallest first. A function of the config alone: every host agrees."""
        first = self.decode_bucket()
        return [first] + [b for b in self.all() if b != first]

    def decode_bucket(self) -> Bucket:
        """The compile unit a step of one token per row (a full batch of decodes) takes."""
        return self.bucket(self.for_step(min(self.max_num_seqs, self.max_num_batched_tokens), 1).tokens)

    def for_step(self, num_tokens: int, num_samples: int, ready: Optional[Iterable[Bucket]] = None) -> Bucket:
        """The bucket of a step of `num_tokens` tokens and `num_samples` sampling slots: the
        smallest T and the smallest R of the compile units `ready` (default all) that hold them."""
        units = self.all() if ready is None else list(ready)
        tokens = [b.tokens for b in units if b.tokens >= num_tokens]
        samples = [b.samples for b in units if b.samples >= num_samples]
        if not tokens or not samples:
            raise ValueError(f"no compiled bucket holds a step of {num_tokens} tokens and {num_samples} samples "
                             f"(have {sorted(units)}); the scheduler must keep steps within the largest (engine bug)")
        return Bucket(min(tokens), min(samples))
