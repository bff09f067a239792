"""The step plan: the scheduler's decision for one step as plain data. Pure Python and numpy.

`StepPlanner.build` turns a scheduler `Plan` (live `Sequence` objects) into a `StepPlan`: numpy
arrays in a shape bucket, sampling inputs and the sampler's switches. The device side reads
nothing else, so a plan pickles and can be sent to the other hosts of a replica. What maps the
step's outputs back to sequences (`RowSlots`) stays with the engine.

Token layout (see engine.generate.buckets): row k of `plan.rows` (decodes first, then prompt rows)
owns tokens [q_start[k], q_start[k] + q_lens[k]), packed one after another; `token_row` names each
token's row. Every token writes its key and value to `kv_dest` (page * page_size + slot) before
attention reads the pages, so a row sees its own new tokens. Padding sits at the end only: padding
tokens write to the scratch page and belong to the last row; padding rows start where the tokens
end and have q_lens = kv_lens = 0.

Sampling slots: each row samples from its last token, a row with guesses (speculative decoding:
its own token, then the guesses, engine.generate.speculation) from each of its last 1 + k tokens.
The slots are numbered row after row (`RowSlots.slots` names each row's first); slot j samples
from token `sample_index[j]` at position `sampling.position[j]`, and its token lands in slot j of
the step's output.

A row whose last token is still being sampled by the previous step (async scheduling: a
placeholder on the host) takes it from that step's sampled tokens on the device: `prev_slot[t]`
names the slot, and `reads_step` names the step, so a host that did not run that step refuses.
"""

from __future__ import annotations

import dataclasses
import itertools
import zlib
from typing import Iterable, NamedTuple, Optional

import numpy as np

from engine.generate.buckets import Bucket, ShapeBuckets, pow2
from engine.generate.grammar import GrammarCompiler, mask_words
from engine.generate.pages import SCRATCH_PAGE
from engine.generate.scheduler import Plan, Row, Sequence, Status

U32 = 2**32


class StepInputs(NamedTuple):
    """The model's inputs of one step (numpy on the host; a NamedTuple, flattened by jit in C++)."""

    tokens: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    kv_dest: np.ndarray  # i32[T] flat cache slot of each token's key/value; padding -> scratch page
    prev_slot: np.ndarray  # i32[T] slot of the previous step's sampled token that replaces it, or -1
    token_row: np.ndarray  # i32[T] the row each token belongs to (padding tokens: the last row)
    # per row, max_num_seqs rows whatever the bucket (the forward program depends on T alone):
    page_table: np.ndarray  # i32[S, L] pages of each row's sequence over max_model_len (padding -> scratch page 0)
    kv_lens: np.ndarray  # i32[S] tokens in the cache after this step (0 for padding rows)
    q_start: np.ndarray  # i32[S] first token of the row
    q_lens: np.ndarray  # i32[S] tokens of the row in this step (0 for padding rows)
    sample_index: np.ndarray  # i32[N] token each sampling slot samples after (N: max_samples; the head reads [0, R))
    adapter: np.ndarray  # i32[S] LoRA slot of the row's adapter (-1: the base model; padding rows too)


class SamplingInputs(NamedTuple):
    """Per sampling slot parameters, f/i[R] (a row's slots share its request's); the dense arrays
    are None unless `penalize`."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seed: np.ndarray  # u32[R]
    position: np.ndarray  # i32[R] position of the token being sampled
    presence: Optional[np.ndarray] = None
    frequency: Optional[np.ndarray] = None
    repetition: Optional[np.ndarray] = None
    output_counts: Optional[np.ndarray] = None  # f32[R, V] occurrences in the output so far
    prompt_mask: Optional[np.ndarray] = None  # bool[R, V] token occurs in the prompt
    bias: Optional[np.ndarray] = None  # f32[R, V] logit bias; -inf blocks EOS before min_tokens
    allowed: Optional[np.ndarray] = None  # i32[R, ceil(V / 32)] bit t: token t may be sampled (`constrain`)


class SamplerSwitches(NamedTuple):
    """The sampler's static switches (one compiled variant each; see engine.generate.runner.sampler)."""

    random: bool = False
    logprobs: bool = False
    penalize: bool = False
    filter: bool = False
    constrain: bool = False

    @property
    def name(self) -> str:
        """The switches that are on, joined by '+' ('greedy' when none is)."""
        return "+".join(field for field in self._fields if getattr(self, field)) or "greedy"


WARM_SAMPLER_SWITCHES = (SamplerSwitches(), SamplerSwitches(random=True),
                         SamplerSwitches(random=True, logprobs=True), SamplerSwitches(constrain=True),
                         SamplerSwitches(random=True, constrain=True))
"""The variants warm-up compiles (once per distinct row count: a few seconds); penalties and
top-k/p filtering compile on first use."""
FIRST_SAMPLER_SWITCHES = (SamplerSwitches(), SamplerSwitches(random=True))
"""The variants of the first bucket's rows compiled before a replica serves: greedy and random
sampling, what most requests take; its other warm variants are the first background compile."""


class DraftInputs(NamedTuple):
    """What a draft model's propose program reads (engine.generate.runner.draft), per row: rows for a rung
    of the token ladder (one program each), a row that does not propose with token 0 at position
    0 and no pages."""

    tokens: np.ndarray  # i32[S] the sequence's last token (in neither model's cache yet)
    positions: np.ndarray  # i32[S] its position
    page_table: np.ndarray  # i32[S, L] the sequence's pages (past them: the scratch page)
    steps: np.ndarray  # i32[1] decode steps to run: the most guesses a row takes


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


class PromptLogprobInputs(NamedTuple):
    index: np.ndarray  # i32[P] token whose logits predict the target (P a power of two, padded)
    targets: np.ndarray  # i32[P] the prompt token predicted


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Everything the device side needs to run one step, and nothing live."""

    step_id: int
    bucket: Bucket
    inputs: StepInputs
    sampling: SamplingInputs
    switches: SamplerSwitches
    prompt_logprobs: Optional[PromptLogprobInputs] = None
    reads_step: Optional[int] = None
    """The step whose sampled tokens `inputs.prev_slot` indexes (None: no token is pending)."""

    @property
    def fingerprint(self) -> int:
        """What every host of a replica must agree on before running the step: its id and every
        static shape and switch (a host that compiled another program would silently compute
        garbage with its peers)."""
        shapes = [a.shape for a in (*self.inputs, *self.sampling) if a is not None]
        prompt = None if self.prompt_logprobs is None else self.prompt_logprobs.index.shape
        text = repr((self.step_id, self.bucket, tuple(self.switches), shapes, prompt, self.reads_step))
        return zlib.crc32(text.encode()) & 0x7FFFFFFF  # fits the int32 a device all-gather carries


class StepOutput(NamedTuple):
    """What a step produced, on the host: the device side's answer to a `StepPlan`."""

    tokens: np.ndarray  # i32[R] sampled token of each sampling slot (padding slots: garbage)
    logprobs: Optional[np.ndarray] = None  # f32[R] of the sampled token, when the switches asked
    top_ids: Optional[np.ndarray] = None  # i32[R, 20]
    top_logprobs: Optional[np.ndarray] = None  # f32[R, 20]
    prompt: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None
    """(logprob of each target, top ids, top logprobs) for `StepPlan.prompt_logprobs`."""


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
        sampling, switches = self._sampling_inputs(rows, bucket.rows, defer_masks)
        prompt_lps, prompt_rows = self._prompt_logprob_inputs(plan, starts)
        step = StepPlan(step_id, bucket, inputs, sampling, switches, prompt_lps,
                        previous.step_id if reads_previous else None)
        slot_of = {row.seq.request_id: slot for slot, row in rows if row.samples and not row.drafts}
        return step, RowSlots(step_id, slots, slot_of, prompt_rows, bucket.rows)

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
        return PromptLogprobInputs(np.asarray(index + [0] * pad, np.int32), np.asarray(targets + [0] * pad, np.int32)), owners


def empty_step_plan(bucket: Bucket, buckets: ShapeBuckets, step_id: int,
                    switches: SamplerSwitches = SamplerSwitches()) -> StepPlan:
    """A step of padding only (every write goes to the scratch page): warm-up compiles with it
    exactly the arrays `StepPlanner.build` makes."""
    n = bucket.rows
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
    )
