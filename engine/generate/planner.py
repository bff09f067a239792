"""The step planner: the scheduler's decision for one step (a `Plan` of live `Sequence` objects)
turned into a `StepPlan` (engine.step.plan): numpy arrays in a shape bucket, sampling inputs and
the sampler's switches. What maps the step's outputs back to sequences (`RowSlots`) stays with
the engine. Pure Python and numpy. The token layout and sampling slots: engine.step.plan.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterable, Optional

import numpy as np

from engine.generate.grammar import GrammarCompiler, mask_words
from engine.generate.pages import SCRATCH_PAGE
from engine.generate.scheduler import Plan, Row, Sequence, Status
from engine.step.buckets import Bucket, ShapeBuckets, pow2
from engine.step.plan import DraftInputs, PromptLogprobInputs, SamplerSwitches, SamplingInputs, StepInputs, StepPlan

U32 = 2**32


def draft_inputs(buckets: ShapeBuckets, sequences: list[Sequence], steps: int = 0,
                 ready: Optional[Iterable[Bucket]] = None) -> DraftInputs:
    """The propose program's inputs for sequences whose every token is known, in rows 0.., and
    `steps` guesses: as many rows as the smallest rung of the ready buckets (default all) that
    holds them (at least 1)."""
    rows, width = buckets.for_step(max(1, len(sequences)), 1, ready).tokens, buckets.max_pages_per_seq
    tokens, positions = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    page_table = np.full((rows, width), SCRATCH_PAGE, np.int32)
    for row, seq in enumerate(sequences):
        tokens[row], positions[row] = seq.token_ids[-1], seq.num_tokens - 1
        page_table[row, : len(seq.pages)] = seq.pages
    return DraftInputs(tokens, positions, page_table, np.array([steps], np.int32))


@dataclasses.dataclass(frozen=True)
class RowSlots:
    """Host-side map from a plan's rows to its step's outputs."""

    step_id: int
    slots: list[int]
    """First sampling slot of each row of `plan.rows` (a row with guesses has 1 + k in a row)."""
    slot_of: dict[str, int]
    """Sampling slot of each row that samples and has no guesses, by request id (what the next
    step reads: a row with guesses is fetched before the next step is planned)."""
    prompt_rows: list[int]
    """For each prompt logprob entry: the index (into `plan.rows`) of the row it belongs to."""
    num_slots: int = 0
    """Sampling slots of the step (its bucket's rows)."""


class StepPlanner:
    """Builds step plans for one engine: its buckets, page size, vocabulary and EOS ids."""

    def __init__(self, buckets: ShapeBuckets, vocab_size: int, eos_token_ids: tuple[int, ...],
                 grammars: Optional[GrammarCompiler] = None):
        """`grammars` fills constrained rows' masks (None where no row is ever constrained)."""
        self.grammars = grammars
        self.buckets = buckets
        self.page_size = buckets.page_size
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def build(self, plan: Plan, step_id: int, previous: Optional[RowSlots] = None, defer_masks: bool = False,
              ready: Optional[Iterable[Bucket]] = None) -> tuple[StepPlan, RowSlots]:
        """The plan of one step. `previous`: the step in flight, whose sampled tokens fill the
        placeholders of this one. `defer_masks`: leave `sampling.allowed` None even when a row
        is constrained (`allowed_tokens` makes it once the grammars have seen `previous`'s tokens).
        `ready`: the buckets the step may take (default: any)."""
        bucket = self.buckets.for_step(plan.num_tokens, plan.num_samples, ready)
        inputs = _empty_inputs(bucket, self.buckets)
        starts = list(itertools.accumulate((row.num_tokens for row in plan.rows), initial=0))
        slots = list(itertools.accumulate((row.num_samples for row in plan.rows), initial=0))[:-1]
        reads_previous = False
        for k, (row, start, slot) in enumerate(zip(plan.rows, starts, slots)):
            reads_previous |= self._fill_row(row, start, k, slot, inputs, previous)
        end = starts[len(plan.rows)]
        inputs.q_start[len(plan.rows):] = end  # padding rows start where the tokens end: q_start stays sorted
        inputs.token_row[end:] = self.buckets.max_rows - 1
        rows = list(zip(slots, plan.rows))
        sampling, switches = self._sampling_inputs(rows, bucket.samples, defer_masks)
        prompt_lps, prompt_rows = self._prompt_logprob_inputs(plan, starts)
        step = StepPlan(step_id, bucket, inputs, sampling, switches, prompt_lps,
                        previous.step_id if reads_previous else None)
        slot_of = {row.seq.request_id: slot for slot, row in rows if row.samples and not row.drafts}
        return step, RowSlots(step_id, slots, slot_of, prompt_rows, bucket.samples)

    # ---- internals ----

    def _fill_row(self, row: Row, offset: int, k: int, slot: int, inputs: StepInputs,
                  previous: Optional[RowSlots]) -> bool:
        """Write row `k`'s tokens, its row arrays and its sampling slots from `slot` on; True when
        it reads a token of `previous`."""
        seq, start, end, count = row.seq, row.start, row.start + row.length, row.num_tokens
        page_size = self.page_size
        if count == 1:  # a decode row: scalar stores (numpy's per-call cost dominates at batch 32)
            prompt_len = len(seq.prompt_ids)
            inputs.tokens[offset] = seq.prompt_ids[start] if start < prompt_len else seq.output_ids[start - prompt_len]
            inputs.positions[offset] = start
            inputs.kv_dest[offset] = seq.pages[start // page_size] * page_size + start % page_size
        else:
            span = slice(offset, offset + count)
            pos = np.arange(start, start + count)
            inputs.tokens[span] = seq.token_ids[start:end] + row.drafts
            inputs.positions[span] = pos
            inputs.kv_dest[span] = np.asarray(seq.pages)[pos // page_size] * page_size + pos % page_size
        inputs.token_row[offset : offset + count] = k
        inputs.page_table[k, : len(seq.pages)] = seq.pages
        inputs.kv_lens[k], inputs.q_start[k], inputs.q_lens[k] = start + count, offset, count
        if count == row.length:  # one sampling slot
            inputs.sample_index[slot] = offset + count - 1
        else:
            inputs.sample_index[slot : slot + row.num_samples] = np.arange(offset + row.length - 1, offset + count)
        inputs.adapter[k] = seq.adapter_slot
        inputs.long_rope[k] = seq.long_rope
        if end <= seq.num_known_tokens:
            return False
        # the row's last token is the one `previous` is sampling
        prev = previous.slot_of.get(seq.request_id) if previous is not None else None
        if prev is None or end != seq.num_known_tokens + 1:
            raise RuntimeError(f"request {seq.request_id}: a planned token is pending without a step "
                               "in flight to sample it (engine bug)")
        inputs.prev_slot[offset + row.length - 1] = prev
        return True

    def _sampling_inputs(self, rows: list[tuple[int, Row]], n: int,
                         defer_masks: bool = False) -> tuple[SamplingInputs, SamplerSwitches]:
        """The sampling inputs of `n` slots from (first slot, row) pairs: a row's slots sample the
        positions after each of its last 1 + k tokens, each with its request's parameters."""
        temperature, top_p, min_p = np.zeros(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.float32)
        top_k, seed, position = np.zeros(n, np.int32), np.zeros(n, np.uint32), np.zeros(n, np.int32)
        for i, row in rows:  # scalar stores where a row has one slot (numpy's per-call cost dominates at batch 32)
            params, span = row.seq.params, (i if not row.drafts else slice(i, i + row.num_samples))
            temperature[span], top_k[span], top_p[span], min_p[span] = (params.temperature, params.top_k,
                                                                        params.top_p, params.min_p)
            seed[span] = row.seq.seed % U32
            position[span] = row.seq.num_tokens if not row.drafts else np.arange(
                row.seq.num_tokens, row.seq.num_tokens + row.num_samples)
        params = [row.seq.params for _, row in rows]
        switches = SamplerSwitches(
            random=any(not p.greedy for p in params),
            logprobs=any(p.logprobs is not None for p in params),
            penalize=any(_needs_dense(row) for _, row in rows),
            filter=any(p.needs_filtering and not p.greedy for p in params),
            constrain=any(row.samples and row.seq.grammar is not None for _, row in rows),
        )
        inputs = SamplingInputs(temperature, top_k, top_p, min_p, seed, position)
        if switches.penalize:
            inputs = inputs._replace(**self._dense_inputs(rows, n))
        if switches.constrain and not defer_masks:
            inputs = inputs._replace(allowed=self.allowed_tokens(plan_rows=rows, n=n))
        return inputs, switches

    def allowed_tokens(self, plan_rows: list[tuple[int, Row]], n: int) -> np.ndarray:
        """The token bitmask of a step's `n` sampling slots, from (slot, row) pairs: what each
        constrained row's grammar allows next, every token for the rest (a row of a sequence
        that has finished meanwhile included: its token is dropped)."""
        allowed = np.full((n, mask_words(self.vocab_size)), -1, np.int32)
        constrained = [(row.seq.grammar, i) for i, row in plan_rows
                       if row.samples and row.seq.grammar is not None and row.seq.status is not Status.FINISHED]
        if constrained:
            self.grammars.fill_masks(constrained, allowed)
        return allowed

    def _dense_inputs(self, rows: list[tuple[int, Row]], n: int) -> dict:
        vocab = self.vocab_size
        presence, frequency, repetition = np.zeros(n, np.float32), np.zeros(n, np.float32), np.ones(n, np.float32)
        counts, prompt_mask = np.zeros((n, vocab), np.float32), np.zeros((n, vocab), bool)
        bias = np.zeros((n, vocab), np.float32)
        for i, row in rows:
            seq, params = row.seq, row.seq.params
            presence[i], frequency[i], repetition[i] = (params.presence_penalty, params.frequency_penalty,
                                                         params.repetition_penalty)
            known = seq.output_ids[: len(seq.output_ids) - seq.tokens_in_flight]
            if known:
                counts[i] = np.bincount(np.asarray(known) % vocab, minlength=vocab)
            if params.repetition_penalty != 1.0:
                prompt = np.asarray(seq.prompt_ids)
                prompt_mask[i, prompt[prompt < vocab]] = True  # image tokens are no vocabulary entry
            for token, value in params.logit_bias:
                bias[i, token] += value
            if len(seq.output_ids) < params.min_tokens:
                bias[i, [t for t in (*self.eos_token_ids, *params.stop_token_ids) if t < vocab]] = -np.inf
        return dict(presence=presence, frequency=frequency, repetition=repetition, output_counts=counts,
                    prompt_mask=prompt_mask, bias=bias)

    def _prompt_logprob_inputs(self, plan: Plan, starts: list[int]) -> tuple[Optional[PromptLogprobInputs], list[int]]:
        """For rows of sequences that asked for prompt logprobs: the logits that predict each
        prompt token the row's positions can predict. (None, []) if no row asked."""
        index, targets, owners = [], [], []
        for k, (row, start) in enumerate(zip(plan.rows, starts)):
            if row.seq.params.prompt_logprobs is None:
                continue
            prompt = row.seq.prompt_ids
            for j in range(row.length):
                if row.start + j + 1 < len(prompt):
                    index.append(start + j)
                    targets.append(prompt[row.start + j + 1])
                    owners.append(k)
        if not index:
            return None, []
        pad = pow2(len(index)) - len(index)
        inputs = PromptLogprobInputs(np.asarray(index + [0] * pad, np.int32), np.asarray(targets + [0] * pad, np.int32))
        return inputs, owners


def empty_step_plan(bucket: Bucket, buckets: ShapeBuckets, step_id: int,
                    switches: SamplerSwitches = SamplerSwitches()) -> StepPlan:
    """A step of padding only (every write goes to the scratch page): warm-up compiles with it
    exactly the arrays `StepPlanner.build` makes."""
    n = bucket.samples
    sampling = SamplingInputs(np.zeros(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32),
                              np.zeros(n, np.float32), np.zeros(n, np.uint32), np.zeros(n, np.int32))
    inputs = _empty_inputs(bucket, buckets)
    inputs.token_row[:] = buckets.max_rows - 1
    return StepPlan(step_id, bucket, inputs, sampling, switches)


def _needs_dense(row: Row) -> bool:
    seq = row.seq
    return seq.params.needs_penalties or len(seq.output_ids) < seq.params.min_tokens


def _empty_inputs(bucket: Bucket, buckets: ShapeBuckets) -> StepInputs:
    t, r, max_pages, page_size = bucket.tokens, buckets.max_rows, buckets.max_pages_per_seq, buckets.page_size
    samples = buckets.max_samples
    return StepInputs(
        tokens=np.zeros(t, np.int32),
        positions=np.zeros(t, np.int32),
        kv_dest=np.full(t, SCRATCH_PAGE * page_size, np.int32),
        prev_slot=np.full(t, -1, np.int32),
        token_row=np.zeros(t, np.int32),
        page_table=np.zeros((r, max_pages), np.int32),
        kv_lens=np.zeros(r, np.int32),
        q_start=np.zeros(r, np.int32),
        q_lens=np.zeros(r, np.int32),
        sample_index=np.zeros(samples, np.int32),
        adapter=np.full(r, -1, np.int32),
        long_rope=np.zeros(r, np.bool_),
    )
