"""Shape buckets: the few step shapes XLA compiles, and which one a step takes. Pure Python.

A step's arrays have fixed shapes so that each shape compiles once. The leader picks the bucket
(every host of a replica must run the same shapes), and the step plan carries it.

Two token layouts; an attention backend declares which one it reads:

- **padded** (cpu, xla): decode rows first, one token each, then prefill rows of `prefill_chunk`
  token slots each. Decode rows `Sd` and prefill rows `Sp` round up to powers of two; a step with
  both pads its decodes to a quarter of the maximum or to the maximum (two tiers, so a few decodes
  beside a prompt chunk do not carry `max_num_seqs` padding rows through every layer and the LM
  head). Pages per row `L` round up to powers of two from `min_bucket_pages`.
- **ragged** (tpu): rows packed one after another, no padding inside a step but at its end; rows
  `R` and tokens `T` each round up to a power of two (T >= R). Every row's page table spans
  `max_model_len`: a ragged paged attention kernel reads only the pages a row's length covers.
"""

from __future__ import annotations

import dataclasses
import itertools


def pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Bucket:
    """The static shapes of one step."""

    decode_rows: int
    """Sd: rows [0, Sd) hold one token each, at tokens [0, Sd) (padded layout; 0 when ragged)."""
    rows: int
    """R: rows of the step (each samples at most one token)."""
    tokens: int
    """T: token slots of the step."""
    pages: int
    """L: page-table columns of every row."""
    chunk: int
    """Token slots of a prefill row (padded layout); 0: ragged, rows packed."""

    @property
    def ragged(self) -> bool:
        return self.chunk == 0

    @property
    def prefill_rows(self) -> int:
        return self.rows - self.decode_rows


@dataclasses.dataclass(frozen=True)
class ShapeBuckets:
    """The bucket policy of one engine; see the module docstring."""

    ragged: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_chunk: int
    max_pages_per_seq: int
    page_size: int

    @property
    def max_decode_rows(self) -> int:
        return pow2(self.max_num_seqs)

    @property
    def max_prefill_rows(self) -> int:
        """Prefill rows one step holds at most (the scheduler's limit)."""
        if self.ragged:
            return self.max_decode_rows
        return pow2(max(1, self.max_num_batched_tokens // self.prefill_chunk))

    @property
    def max_rows(self) -> int:
        """Sampled rows of a step at most: the length of every step's sampled-token array."""
        return self.max_decode_rows if self.ragged else self.max_decode_rows + self.max_prefill_rows

    @property
    def mixed_decode_rows(self) -> list[int]:
        """Padded layout: the decode rows a step with prompt chunks pads to."""
        return sorted({max(1, self.max_decode_rows // 4), self.max_decode_rows})

    @property
    def page_buckets(self) -> list[int]:
        if self.ragged:
            return [self.max_pages_per_seq]
        start = min(self.max_pages_per_seq, pow2(-(-256 // self.page_size)))
        buckets = [start]
        while buckets[-1] < self.max_pages_per_seq:
            buckets.append(min(2 * buckets[-1], self.max_pages_per_seq))
        return buckets

    def for_step(self, num_decode: int, prefill_lengths: list[int], pages_needed: int) -> Bucket:
        """The bucket of a step with `num_decode` one-token rows first, then rows of
        `prefill_lengths` tokens, whose longest row needs `pages_needed` pages."""
        pages = next(b for b in self.page_buckets if b >= pages_needed)
        if self.ragged:
            rows = pow2(num_decode + len(prefill_lengths))
            return Bucket(0, rows, max(rows, pow2(num_decode + sum(prefill_lengths))), pages, 0)
        sp = pow2(len(prefill_lengths)) if prefill_lengths else 0
        if not num_decode:
            sd = 0
        elif sp:
            sd = next(d for d in self.mixed_decode_rows if d >= num_decode)
        else:
            sd = pow2(num_decode)
        return self._padded(sd, sp, pages)

    def all(self) -> list[Bucket]:
        """Every bucket `for_step` can pick (what warm-up compiles)."""
        if self.ragged:
            rows = [1 << i for i in range(self.max_decode_rows.bit_length())]
            max_tokens = pow2(self.max_num_batched_tokens)
            shapes = [(r, 1 << i) for r in rows for i in range(max_tokens.bit_length()) if 1 << i >= r]
            return [Bucket(0, r, t, pages, 0) for (r, t), pages in itertools.product(shapes, self.page_buckets)]
        sd = [1 << i for i in range(self.max_decode_rows.bit_length())]
        sp = [1 << i for i in range(self.max_prefill_rows.bit_length())]
        shapes = [(d, 0) for d in sd] + [(0, p) for p in sp] + [(d, p) for d in self.mixed_decode_rows for p in sp]
        return [self._padded(d, p, pages) for (d, p), pages in itertools.product(shapes, self.page_buckets)]

    def _padded(self, sd: int, sp: int, pages: int) -> Bucket:
        return Bucket(sd, sd + sp, sd + sp * self.prefill_chunk, pages, self.prefill_chunk)
