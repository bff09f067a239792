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

`Speculator` is the engine's manager of all this: which decoding rows carry guesses and how many
(sharing the step's spare token slots), whether the next step likely carries any (the engine then
waits for the step in flight first: guesses are made only from tokens the host has), and which
guesses a step kept, counted for the stats.
"""

from __future__ import annotations

from typing import Any, Callable, Optional
from typing import Sequence as Tokens

import numpy as np

from engine.config import SpeculativeConfig
from engine.generate.planner import draft_inputs
from engine.generate.scheduler import Row, Scheduler, Sequence
from engine.step.buckets import Bucket, ShapeBuckets
from engine.step.plan import DraftInputs


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


class Speculator:
    """Guesses for the scheduler's decoding sequences, and what a step keeps of them. Without
    speculative decoding (`config` None) it guesses nothing and keeps each row's sampled token."""

    def __init__(self, config: Optional[SpeculativeConfig], scheduler: Scheduler, flat_step_tokens: int,
                 buckets: ShapeBuckets, propose: Callable[[DraftInputs], Any]):
        """`flat_step_tokens`: the step's token slots unless `config.max_step_tokens` says fewer;
        `propose`: runs the draft model's propose program (its rows' guesses, [rows, steps])."""
        self.enabled = config is not None
        self.max_drafts = 0 if config is None else config.num_tokens
        self.proposer = NgramProposer(config) if config is not None and config.method == "ngram" else None
        """Prompt-lookup guesses for decoding rows (speculative decoding by n-gram), or None."""
        self.max_step_tokens = (config.max_step_tokens if config is not None else None) or flat_step_tokens
        """Token slots a step's decoding rows and their guesses take at most."""
        self.scheduler = scheduler
        self.max_model_len = scheduler.config.max_model_len
        self._buckets, self._propose = buckets, propose
        self.num_drafts = 0  # rows that carried guesses
        self.num_draft_tokens = 0  # guesses checked
        self.num_accepted_tokens = 0  # of those, kept

    def guesses_likely(self) -> bool:
        """Whether the next step would likely carry guesses, which needs the tokens in flight on
        the host first: the step has room for them, and a decoding sequence's known tokens
        already repeat (prompt lookup) or a draft model can guess for one."""
        if not self.enabled:
            return False
        decoding = self._decoding()
        if len(decoding) >= self.max_step_tokens:
            return False
        if self.proposer is None:  # a draft model guesses whatever the text
            return any(draft_limit(seq, self.max_model_len) for seq in decoding)
        return any(self.proposer.propose(seq.token_ids[: seq.num_known_tokens], 1)
                   for seq in decoding if draft_limit(seq, self.max_model_len))

    def drafts(self, ready: list[Bucket]) -> dict[str, list[int]]:
        """Guesses for the decoding sequences whose every token is on the host, by request id,
        sharing the token slots `max_step_tokens` leaves beside the decoding rows' own. `ready`:
        the buckets compiled so far (a draft model's propose program takes a ready size)."""
        if not self.enabled:
            return {}
        decoding = self._decoding()
        spare = self.max_step_tokens - len(decoding)
        limits = [(seq, 0 if seq.tokens_in_flight else min(self.max_drafts, draft_limit(seq, self.max_model_len)))
                  for seq in decoding]
        limits = [(seq, limit) for seq, limit in limits if limit] if spare > 0 else []
        if self.proposer is None:  # a draft guesses every row: share the slots first, then draft that many
            limits = [(seq, n) for (seq, _), n in zip(limits, share_slots([n for _, n in limits], spare)) if n]
        proposed = self._guesses(limits, ready)
        counts = share_slots([len(g) for g in proposed.values()], spare)
        return {rid: guesses[:n] for (rid, guesses), n in zip(proposed.items(), counts) if n}

    def keep(self, row: Row, sampled: list[int]) -> list[int]:
        """The tokens a row emits: its sampled token, or for a row with guesses the guesses the
        model agreed with and the token after them (`kept_tokens`)."""
        if not row.drafts:
            return sampled[:1]
        tokens = kept_tokens(row.drafts, sampled)
        self.num_drafts += 1
        self.num_draft_tokens += len(row.drafts)
        self.num_accepted_tokens += len(tokens) - 1
        return tokens

    def _decoding(self) -> list[Sequence]:
        return [seq for seq in self.scheduler.running if seq.num_pending == 1]

    def _guesses(self, sequences: list[tuple[Sequence, int]], ready: list[Bucket]) -> dict[str, list[int]]:
        """Up to `limit` guesses for each (sequence, limit), by request id: prompt lookup's, or
        the draft model's (one program for them all, as many decode steps as the largest limit)."""
        if self.proposer is not None:
            guesses = {seq.request_id: self.proposer.propose(seq.token_ids, limit) for seq, limit in sequences}
            return {rid: tokens for rid, tokens in guesses.items() if tokens}
        if not sequences:
            return {}
        for seq, limit in sequences:  # the draft writes keys and values where its guesses will stand
            self.scheduler.reserve_ahead(seq, limit)
        steps = max(limit for _, limit in sequences)
        drafted = self._propose(draft_inputs(self._buckets, [seq for seq, _ in sequences], steps, ready))
        return {seq.request_id: [int(t) for t in drafted[row, :limit]] for row, (seq, limit) in enumerate(sequences)}
