"""What a fetched step's results do to its sequences: the tokens each row keeps, why a sequence
ends, and the `TokenDelta` its stream gets. Pure Python.

A launched step already advanced its rows (a `PENDING_TOKEN` per sampled token, see
engine.generate.engine); here the sampled tokens replace the placeholders, a row with guesses
appends the guesses the model agreed with (engine.generate.speculation), constrained rows' grammars
take their tokens, and a sequence that ends drops the tokens after its last one sent. A sequence
that ended before its row's results arrived (aborted, or ended by the step before while this one
ran) gets nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from engine.generate.grammar import GrammarCompiler
from engine.generate.planner import RowSlots
from engine.generate.request import FinishReason, TokenDelta, TokenLogprob
from engine.generate.scheduler import Plan, Row, Sequence, Status
from engine.generate.speculation import Speculator
from engine.step.plan import StepOutput


@dataclasses.dataclass(frozen=True)
class RowResult:
    """What one row of a step produced (`tokens` are meaningful only when the row samples): the
    token sampled in each of its sampling slots (one, or 1 + its guesses)."""

    tokens: list[int]
    logprobs: Optional[list[TokenLogprob]]
    prompt_logprobs: list[TokenLogprob]
    """For rows of a sequence that asked for prompt logprobs: one per prompt token this row
    predicts (tokens start+1 .. of the prompt)."""


class Postprocessor:
    """Turns a step's outputs into its sequences' new tokens and their streams' deltas."""

    def __init__(self, grammars: GrammarCompiler, speculator: Speculator, eos_token_ids: frozenset[int],
                 max_model_len: int):
        self.grammars = grammars
        self.speculator = speculator
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def process(self, plan: Plan, slots: RowSlots, out: StepOutput) -> tuple[list[TokenDelta], list[Sequence]]:
        """(the deltas of `plan`'s rows that produced one, in row order; the sequences they
        finish, which the caller ends)."""
        results = _row_results(plan, slots, out)
        over = self._feed_grammars(plan.rows, results)
        deltas = [self._advance(row, result, over.get(row.seq.request_id, False))
                  for row, result in zip(plan.rows, results)]
        sent = [(row.seq, delta) for row, delta in zip(plan.rows, deltas) if delta is not None]
        return [delta for _, delta in sent], [seq for seq, delta in sent if delta.finished]

    def _feed_grammars(self, rows: list[Row], results: list[RowResult]) -> dict[str, bool]:
        """Feed constrained rows' sampled tokens to their grammars, all at once; per request id,
        whether its grammar ends the output."""
        fed = [(row.seq, result.tokens[0]) for row, result in zip(rows, results)
               if row.samples and row.seq.grammar is not None and row.seq.status is not Status.FINISHED]
        if not fed:
            return {}
        over = self.grammars.advance([(seq.grammar, token) for seq, token in fed])
        return {seq.request_id: done for (seq, _), done in zip(fed, over)}

    def _advance(self, row: Row, result: RowResult, grammar_done: bool) -> Optional[TokenDelta]:
        seq = row.seq
        if seq.status is Status.FINISHED:  # aborted, or ended by the step before while this one ran
            return None
        for k, logprob in enumerate(result.prompt_logprobs):
            seq.prompt_logprobs[row.start + 1 + k] = logprob
        if not row.samples:
            return None
        generated = row.start + row.length - len(seq.prompt_ids) + 1  # outputs up to this row's token
        tokens = self.speculator.keep(row, result.tokens)
        seq.output_ids[generated - 1] = tokens[0]
        seq.tokens_in_flight -= 1
        seq.output_ids += tokens[1:]  # a row with guesses: none of the sequence's tokens is in flight
        seq.num_computed += len(tokens) - 1  # the guesses kept are in the cache already
        reason = None
        for count in range(generated, generated + len(tokens)):
            reason = self._finish_reason(seq, count, grammar_done)
            if reason is not None:
                tokens = tokens[: count - generated + 1]
                break
        logprobs = None if result.logprobs is None else result.logprobs[: len(tokens)]
        delta = TokenDelta(seq.request_id, tokens, logprobs=logprobs, finish_reason=reason)
        if not seq.sent_first:
            _add_prompt_facts(seq, delta)
        if delta.finished:
            del seq.output_ids[generated + len(tokens) - 1 :]  # tokens after the last one sent, never sent
            seq.tokens_in_flight = 0
        return delta

    def _finish_reason(self, seq: Sequence, generated: int, grammar_done: bool) -> Optional[FinishReason]:
        """Why the sequence ends with its first `generated` output tokens, if it does."""
        params, last = seq.params, seq.output_ids[generated - 1]
        if grammar_done or (generated >= params.min_tokens and (
            last in params.stop_token_ids or (not params.ignore_eos and last in self.eos_token_ids)
        )):
            return FinishReason.STOP
        if seq.ends_by_length(generated, self.max_model_len):
            return FinishReason.LENGTH
        return None


def _add_prompt_facts(seq: Sequence, delta: TokenDelta) -> None:
    """The sequence's first delta carries its prompt's bookkeeping."""
    seq.sent_first = True
    delta.num_prompt_tokens = len(seq.prompt_ids)
    delta.num_cached_tokens = seq.num_cached_prompt
    delta.scheduled_time = seq.scheduled_time
    if seq.params.prompt_logprobs is not None:
        delta.prompt_logprobs = list(seq.prompt_logprobs)


def _row_results(plan: Plan, slots: RowSlots, out: StepOutput) -> list[RowResult]:
    """One result per row of `plan.rows`, read from the step's outputs."""
    prompt: list[list[TokenLogprob]] = [[] for _ in plan.rows]
    if out.prompt is not None:
        chosen, top_ids, top_lps = out.prompt
        for k, r in enumerate(slots.prompt_rows):
            seq = plan.rows[r].seq
            target = seq.prompt_ids[plan.rows[r].start + len(prompt[r]) + 1]
            prompt[r].append(_token_logprob(target, chosen[k], top_ids[k], top_lps[k], seq.params.prompt_logprobs))
    results = []
    for row, first, prompt_lps in zip(plan.rows, slots.slots, prompt):
        span, k = range(first, first + row.num_samples), row.seq.params.logprobs
        tokens = [int(out.tokens[slot]) for slot in span]
        logprobs = None if k is None else [
            _token_logprob(token, out.logprobs[slot], out.top_ids[slot], out.top_logprobs[slot], k)
            for token, slot in zip(tokens, span)]
        results.append(RowResult(tokens, logprobs, prompt_lps))
    return results


def _token_logprob(token: int, logprob, top_ids, top_lps, k: int) -> TokenLogprob:
    top = tuple((int(t), float(lp)) for t, lp in zip(top_ids[:k], top_lps[:k]))
    return TokenLogprob(int(token), float(logprob), top)
