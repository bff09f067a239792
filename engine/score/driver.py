"""Runs a score engine on a background thread and merges concurrent callers into batches.

A pair (a query and a document, as the tokenizer encodes them together) travels to the engine as
one packed row, `[first_segment_length, *token_ids]`, so the score engine speaks the embedding
driver's protocol (engine.embed.driver: `validate` and `embed` over lists of ints, here returning
one score a row) and `AsyncScorer` is that driver: the same batching across callers, the same
failure and shutdown rules.

Pure Python: importing this module does not import jax.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from engine.embed.driver import AsyncEmbedder


@dataclasses.dataclass(frozen=True)
class Pair:
    """One (query, document) pair as token ids: the tokenizer's pair encoding."""

    token_ids: list[int]
    first_segment: int
    """How many of `token_ids` belong to the first text (token type 0; the rest are type 1). A
    model without token types gets all of them (the length of `token_ids`)."""

    def packed(self) -> list[int]:
        return [self.first_segment, *self.token_ids]


def unpack(row: list[int]) -> Pair:
    """The pair a packed row carries."""
    return Pair(list(row[1:]), row[0])


class AsyncScorer(AsyncEmbedder):
    """AsyncEmbedder over a score engine (engine.score.engine): `score()` is the request-facing API."""

    async def score(self, pairs: list[Pair]) -> np.ndarray:
        """float32 [len(pairs)]: each pair's score. Raises InvalidRequestError before anything is queued
        if a pair can never be scored, EngineDeadError if the worker died."""
        return (await self.embed([pair.packed() for pair in pairs]))[:, 0]
