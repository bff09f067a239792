"""engine.generate.planner: step plans built from real scheduler runs, without a model: the exact
arrays of the packed token layout, pending tokens read from the step in flight, sampling inputs,
prompt logprobs, and plans that pickle into plain data."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from engine.generate.pages import PageAllocator
from engine.generate.planner import RowSlots, StepPlanner
from engine.generate.request import SamplingParams
from engine.generate.scheduler import (
    PENDING_TOKEN,
    Plan,
    Scheduler,
    SchedulerConfig,
    Sequence,
)
from engine.step.buckets import Bucket, ShapeBuckets
from engine.step.plan import StepPlan

PAGE = 4
VOCAB = 64
EOS = (2,)


def setup() -> tuple[Scheduler, StepPlanner]:
    buckets = ShapeBuckets(max_num_seqs=4, max_num_batched_tokens=24, max_pages_per_seq=8, page_size=PAGE)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, prefill_chunk=8, max_model_len=32)
    return Scheduler(config, PageAllocator(40, PAGE, True)), StepPlanner(buckets, VOCAB, EOS)


def launched(plan: Plan, token: int = PENDING_TOKEN) -> None:
    """Advance every row as the engine does when it launches a step (`token`: the sampled one,
    or a placeholder still in flight)."""
    for row in plan.rows:
        row.seq.num_computed += row.length
        if row.samples:
            row.seq.output_ids.append(token)
            row.seq.tokens_in_flight += token == PENDING_TOKEN


def decode_and_chunk():
    """A decoding (prompt 5, one output token 33) next to the first 8-token chunk of B (prompt 10)."""
    sched, planner = setup()
    a = Sequence("a", [10, 11, 12, 13, 14], SamplingParams(max_tokens=8), seed=7)
    sched.add(a)
    launched(sched.schedule(), token=33)
    b = Sequence("b", list(range(40, 50)), SamplingParams(max_tokens=8, temperature=0.5, top_p=0.9), seed=2**32 + 3)
    sched.add(b)
    plan = sched.schedule()
    assert [(r.seq.request_id, r.start, r.length) for r in plan.rows] == [("a", 5, 1), ("b", 0, 8)]
    return plan, planner, a, b


def dest(seq: Sequence, positions) -> list[int]:
    return [seq.pages[p // PAGE] * PAGE + p % PAGE for p in positions]


def table(seq: Sequence) -> list[int]:
    return seq.pages + [0] * (8 - len(seq.pages))


def test_rows_are_packed_decodes_first_and_only_the_end_is_padded():
    plan, planner, a, b = decode_and_chunk()
    step, slots = planner.build(plan, step_id=1)
    assert step.bucket == Bucket(tokens=16, samples=4)
    x = step.inputs
    assert x.tokens.tolist() == [33, *range(40, 48)] + [0] * 7
    assert x.positions.tolist() == [5, *range(8)] + [0] * 7
    assert x.kv_dest.tolist() == dest(a, [5]) + dest(b, range(8)) + [0] * 7  # padding -> scratch page 0
    assert x.prev_slot.tolist() == [-1] * 16
    assert x.token_row.tolist() == [0] + [1] * 8 + [3] * 7  # padding tokens belong to the last row
    assert x.page_table.tolist() == [table(a), table(b), [0] * 8, [0] * 8]
    assert (x.kv_lens.tolist(), x.q_start.tolist(), x.q_lens.tolist()) == ([6, 8, 0, 0], [0, 1, 9, 9], [1, 8, 0, 0])
    assert x.sample_index.tolist() == [0, 8, 0, 0]
    assert slots == RowSlots(1, [0, 1], {"a": 0}, [], 4)  # b's chunk does not reach its prompt's end
    assert step.reads_step is None and step.prompt_logprobs is None


def test_a_step_takes_a_ready_bucket():
    plan, planner, _, _ = decode_and_chunk()
    step, slots = planner.build(plan, step_id=1, ready=[Bucket(1, 1), Bucket(24, 4)])
    assert step.bucket == Bucket(24, 4) and step.inputs.tokens.shape == (24,)
    assert step.inputs.token_row.tolist()[9:] == [3] * 15


def test_padding_rows_start_where_the_tokens_end():
    """cu_q_lens = q_start + [end] must not decrease: padding rows sit at the end of the tokens."""
    sched, planner = setup()
    for rid, n in (("a", 3), ("b", 2), ("c", 4)):
        sched.add(Sequence(rid, list(range(10, 10 + n)), SamplingParams(), seed=0))
    step, _ = planner.build(sched.schedule(), step_id=0)
    assert step.bucket == Bucket(16, 4)
    assert step.inputs.q_start.tolist() == [0, 3, 5, 9]
    assert step.inputs.q_lens.tolist() == [3, 2, 4, 0]


def test_a_pending_token_is_read_from_the_step_in_flight():
    """Async scheduling: a's output token is still being sampled by step 4 (slot 0 there); the
    next step names step 4 and takes the token from that slot."""
    sched, planner = setup()
    a = Sequence("a", [10, 11, 12], SamplingParams(max_tokens=8), seed=0)
    sched.add(a)
    first = sched.schedule()
    _, in_flight = planner.build(first, step_id=4)
    launched(first)  # a's first output is a placeholder
    plan = sched.schedule()
    step, _ = planner.build(plan, step_id=5, previous=in_flight)
    assert a.output_ids == [PENDING_TOKEN]
    assert step.reads_step == 4
    assert step.inputs.prev_slot.tolist() == [in_flight.slot_of["a"]]
    with pytest.raises(RuntimeError, match="pending without a step in flight"):
        planner.build(plan, step_id=5)


def test_sampling_inputs_switches_and_dense_penalties():
    sched, planner = setup()
    greedy = Sequence("g", [5, 6], SamplingParams(), seed=1)
    picky = Sequence("p", [7, 8, 9], SamplingParams(temperature=0.7, top_k=5, presence_penalty=0.5,
                                                    logit_bias=((3, 2.5),), min_tokens=2, stop_token_ids=(9,),
                                                    logprobs=2), seed=11)
    sched.add(greedy)
    sched.add(picky)
    step, slots = planner.build(sched.schedule(), step_id=0)
    assert slots.slots == [0, 1] and step.bucket == Bucket(8, 4)  # 5 tokens, 2 rows
    assert step.switches == (True, True, True, True, False)
    s = step.sampling
    assert s.temperature.tolist() == pytest.approx([0.0, 0.7, 0.0, 0.0])
    assert (s.top_k.tolist(), s.seed.tolist(), s.position.tolist()) == ([0, 5, 0, 0], [1, 11, 0, 0], [2, 3, 0, 0])
    assert s.presence.tolist() == [0.0, 0.5, 0.0, 0.0] and s.bias.shape == (4, VOCAB)
    assert s.bias[1, 3] == 2.5 and s.bias[1, 2] == s.bias[1, 9] == -np.inf  # EOS and stop blocked
    assert not s.bias[0].any()


def test_prompt_logprob_targets_are_the_next_prompt_tokens():
    sched, planner = setup()
    sched.add(Sequence("e", [20, 21, 22, 23, 24, 25], SamplingParams(prompt_logprobs=1), seed=0))
    step, slots = planner.build(sched.schedule(), step_id=0)
    index, targets = step.prompt_logprobs
    assert index.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]  # the last position predicts an output token
    assert targets.tolist() == [21, 22, 23, 24, 25, 0, 0, 0]
    assert slots.prompt_rows == [0] * 5


def test_a_step_plan_is_plain_data_that_survives_pickling():
    plan, planner, _, _ = decode_and_chunk()
    step, _ = planner.build(plan, step_id=9)
    assert _plain(step)
    copy = pickle.loads(pickle.dumps(step))
    assert (copy.step_id, copy.bucket, copy.switches, copy.reads_step) == (9, step.bucket, step.switches, None)
    for name in ("inputs", "sampling"):
        for got, want in zip(getattr(copy, name), getattr(step, name)):
            assert (got is None and want is None) or (got.dtype == want.dtype and np.array_equal(got, want))


def _plain(value) -> bool:
    """Only numpy arrays, numbers, bools, None, buckets and tuples of them: nothing live."""
    if isinstance(value, StepPlan):
        return all(_plain(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (np.ndarray, int, float, bool, Bucket))


class OnlyToken:
    """A grammar state that allows one token."""

    def __init__(self, token: int):
        self.token = token


class OnlyTokenMasks:
    """The planner's view of engine.generate.grammar.GrammarCompiler, for OnlyToken states."""

    def fill_masks(self, rows, out: np.ndarray) -> None:
        for state, i in rows:
            out[i] = 0
            out[i, state.token // 32] = np.uint32(1 << (state.token % 32)).view(np.int32)


def test_constrained_rows_get_their_grammars_masks_now_or_deferred():
    sched, planner = setup()
    planner.grammars = OnlyTokenMasks()
    free = Sequence("f", [5, 6], SamplingParams(), seed=1)
    constrained = Sequence("c", [7, 8, 9], SamplingParams(), seed=2)
    constrained.grammar = OnlyToken(40)
    sched.add(free)
    sched.add(constrained)
    plan = sched.schedule()
    step, slots = planner.build(plan, step_id=0)
    assert step.switches.constrain and step.sampling.allowed.shape == (4, 2)  # 4 row slots, ceil(64 / 32) words
    assert step.sampling.allowed[0].tolist() == [-1, -1]  # the free row: every token
    assert step.sampling.allowed[1].view(np.uint32).tolist() == [0, 1 << 8]  # token 40 only
    deferred, slots = planner.build(plan, step_id=0, defer_masks=True)
    assert deferred.switches.constrain and deferred.sampling.allowed is None
    later = planner.allowed_tokens(list(zip(slots.slots, plan.rows)), slots.num_slots)
    assert np.array_equal(later, step.sampling.allowed)
