"""Speculative decoding: guessing a sequence's next tokens, and keeping the right guesses. Pure
Python and numpy.

A decoding row normally computes one token (the last one sampled) and samples the next. With
guesses ("drafts") d1..dk it computes k + 1 tokens, [last, d1, .., dk], and samples after each
of them: s0 after `last`, s1 after d1, and so on, every one with the randomness decoding one
token at a time would use there (the sampler's key is the request's seed and the position). The
engine keeps s0, then s1 if d1 == s0 (d1 was the token the model samples there, so s1 is what
it samples next), and so on: the first guess that differs from the model's own token ends the
row, with the model's token in its place, and when every guess holds, s_k comes on top.

So greedy output is the argmax decoding one token at a time makes, and a seeded request samples
the very tokens it would without speculation. For a random draw this is the standard rejection
sampling of speculative decoding with a draft that puts all its probability on its guess: a
guess d is kept with probability p(d), and where it is not, the token comes from p without d,
renormalized.

Guesses come from `NgramProposer` (prompt lookup: the sequence's last n tokens are found earlier
in the sequence and the tokens after their latest occurrence are the guesses), or from a draft
model on the devices (engine.generate.runner.draft), which guesses greedily too.
"""

from __future__ import annotations

from typing import Sequence as Tokens

import numpy as np

from engine.config import SpeculativeConfig
from engine.generate.scheduler import Sequence


class NgramProposer:
    """Prompt-lookup guesses, from the sequence's own tokens."""

    def __init__(self, config: SpeculativeConfig):
        self.num_tokens = config.num_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, tokens: Tokens[int], limit: int) -> list[int]:
        """Up to min(num_tokens, limit) guesses of what follows `tokens`: what followed the latest
        earlier occurrence of its longest suffix of min_n..max_n tokens that occurs earlier."""
        count = min(self.num_tokens, limit)
        if count < 1 or len(tokens) <= self.min_n:
            return []
        ids = np.asarray(tokens, np.int64)
        last = len(ids) - 1
        ends = np.flatnonzero(ids[:last] == ids[last])  # earlier tokens equal to the last one
        matched = np.ones(len(ends), np.int64)
        alive = ends.copy()  # where each candidate's match still extends backwards
        for j in range(1, self.max_n):
            step = (alive >= j) & (ids[np.maximum(ends - j, 0)] == ids[last - j])
            matched += step
            alive = np.where(step, alive, -1)
        best = np.flatnonzero(matched >= self.min_n)
        if best.size == 0:
            return []
        longest = matched[best].max()
        end = ends[best[matched[best] == longest][-1]]  # the latest of the longest matches
        return ids[end + 1 : end + 1 + count].tolist()


def draft_limit(seq: Sequence, max_model_len: int) -> int:
    """Guesses a decoding row of `seq` may carry: none for rows whose sampling depends on the
    tokens before it on the host (penalties, bias, min_tokens, a grammar), and never more than
    its length limit leaves room for. (Guesses also need every token on the host: the caller's
    part, `Sequence.tokens_in_flight`.)"""
    params = seq.params
    if (seq.num_pending != 1 or seq.grammar is not None or params.needs_penalties
            or len(seq.output_ids) < params.min_tokens):
        return 0
    room = min(params.max_tokens, max_model_len - len(seq.prompt_ids)) - len(seq.output_ids)
    return max(0, room - 1)  # the row emits its guesses that hold and one token of its own


def share_slots(wanted: list[int], spare: int) -> list[int]:
    """How many guesses each row takes when the rows share `spare` token slots and row i has
    `wanted[i]`: an even share each, what a row leaves going to the rows that want more (earlier
    rows first). Several rows with a guess or two each keep more tokens than one row with many
    (each further guess in a row holds only if every one before it did)."""
    taken = [0] * len(wanted)
    left = max(0, spare)
    open_rows = [i for i, n in enumerate(wanted) if n > 0]
    while left and open_rows:
        share = max(1, left // len(open_rows))
        for i in list(open_rows):
            give = min(share, wanted[i] - taken[i], left)
            taken[i] += give
            left -= give
            if taken[i] == wanted[i]:
                open_rows.remove(i)
            if not left:
                break
    return taken


def kept_tokens(drafts: list[int], sampled: Tokens[int]) -> list[int]:
    """The tokens a row emits: `sampled[0]`, then `sampled[j + 1]` for as long as each guess
    `drafts[j]` equals the token sampled where it stands (`sampled[j]`)."""
    out = [int(sampled[0])]
    for j, draft in enumerate(drafts):
        if out[-1] != draft:
            break
        out.append(int(sampled[j + 1]))
    return out
