"""engine.generate.scheduler: exact plans (budgets, chunking, row groups, preemption, prefix reuse, counters)
and seeded stress runs that drive the scheduler the way the engine does and check its invariants
after every step. No model: a fake KV cache records which prefix each written slot encodes, so a
row that would read a wrong or unwritten page is caught."""

from __future__ import annotations

import itertools
import random
from typing import Optional

import pytest

from engine.generate.pages import SCRATCH_PAGE, PageAllocator, prefix_hashes
from engine.generate.request import SamplingParams
from engine.generate.scheduler import (
    Plan,
    Row,
    Scheduler,
    SchedulerConfig,
    Sequence,
    Status,
)


def make(
    num_pages: int = 64,
    page_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    prefill_chunk: int = 16,
    max_model_len: int = 64,
    caching: bool = True,
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, prefill_chunk, max_model_len)
    return Scheduler(config, PageAllocator(num_pages, page_size, caching))


_fresh = itertools.count(1)


def seq(rid: str, prompt, max_tokens: int = 4, seed: int = 0, **params) -> Sequence:
    """A sequence; an int prompt is that many tokens no other prompt starts with."""
    if isinstance(prompt, int):
        prompt = [next(_fresh) * 1000 + i for i in range(prompt)]
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params), seed)


def rows(rows: list[Row]) -> list[tuple[str, int, int]]:
    return [(row.seq.request_id, row.start, row.length) for row in rows]


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Sim:
    """Drives a scheduler like the engine: schedule, "run" the rows (write the fake KV cache and
    check every row reads what it should), advance each row, append a token when the row samples,
    finish sequences at max_tokens (or a fake EOS). Checks the invariants after every step."""

    def __init__(self, sched: Scheduler, rng: Optional[random.Random] = None, eos_rate: float = 0.0):
        self.sched = sched
        self.alloc = sched.allocator
        self.ps = sched.page_size
        self.rng = rng
        self.eos_rate = eos_rate
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (page, slot) -> the prefix it encodes
        self.prefix_of_hash: dict[int, tuple[int, ...]] = {}
        self.live: list[Sequence] = []
        self.done: list[Sequence] = []
        self.steps = 0
        self.admitted_while_preempting = 0

    def add(self, *seqs: Sequence) -> None:
        for s in seqs:
            self.sched.add(s)
            self.live.append(s)

    def abort(self, s: Sequence) -> None:
        self.sched.finish(s)
        self.live.remove(s)
        self.done.append(s)
        self.check_state()

    def token(self, s: Sequence) -> int:
        return 1000 + (s.seed * 7919 + len(s.output_ids) * 31) % 997

    def step(self, max_tokens: Optional[int] = None) -> Plan:
        before = {id(s): (s.status, s.num_pending) for s in self.live}
        plan = self.sched.schedule(max_tokens)
        self.steps += 1
        self.check_plan(plan, before, max_tokens)
        self.run(plan)
        finished = []
        for row in plan.rows:
            s = row.seq
            s.num_computed += row.length
            if row.samples:
                s.output_ids.append(self.token(s))
                eos = self.rng is not None and self.rng.random() < self.eos_rate
                if len(s.output_ids) == s.params.max_tokens or eos:
                    finished.append(s)
        for s in finished:
            self.sched.finish(s)
            self.live.remove(s)
            self.done.append(s)
        self.check_state()
        return plan

    def run_all(self, max_steps: int = 10_000) -> None:
        while self.sched.has_work():
            assert self.steps < max_steps, "no progress"
            self.step()
        self.check_all_free()

    # ---- invariants ----

    def check_plan(self, plan: Plan, before: dict, max_tokens: Optional[int] = None) -> None:
        cfg, sched = self.sched.config, self.sched
        row_seqs = [row.seq for row in plan.rows]
        assert len(set(map(id, row_seqs))) == len(row_seqs), "a sequence has two rows"
        assert plan.num_tokens <= min(cfg.max_num_batched_tokens, max_tokens or cfg.max_num_batched_tokens)
        assert len(sched.running) <= cfg.max_num_seqs
        for row in plan.decode:
            assert row.length == 1
        for row in plan.rows:
            s = row.seq
            assert s.status is Status.RUNNING and any(r is s for r in sched.running)
            assert row.start == s.num_computed
            assert 1 <= row.length <= min(s.num_pending, cfg.prefill_chunk)
            assert len(s.pages) == cdiv(row.start + row.length, self.ps)
        for s in plan.preempted:
            assert s.status is Status.WAITING and s.pages == [] and s.num_computed == 0
            assert all(r is not s for r in row_seqs), "a preempted sequence kept its row"
            assert before[id(s)][0] is Status.RUNNING
        admitted = [s for s in row_seqs if before[id(s)][0] is Status.WAITING]
        if plan.preempted:
            assert not admitted, "a waiting sequence was admitted in a step that preempted"
        # Decodes come first: a decoding sequence left out (and not preempted) means the budget went to decodes.
        decoding = [s for s in self.live if before[id(s)] == (Status.RUNNING, 1)]
        skipped = [s for s in decoding if s.status is Status.RUNNING and all(r is not s for r in row_seqs)]
        if skipped:
            assert len(plan.decode) == plan.num_tokens == min(cfg.max_num_batched_tokens,
                                                                max_tokens or cfg.max_num_batched_tokens)
        # A running sequence only goes without a row for lack of budget or pages.
        if not plan.rows:
            assert plan.preempted or not sched.running

    def run(self, plan: Plan) -> None:
        """Write every row's keys/values, then check every row sees its whole prefix (rows of the
        same step may read each other's pages: n>1 siblings) and every cached page holds its prefix."""
        for row in plan.rows:
            tokens = row.seq.token_ids
            for pos in range(row.start, row.start + row.length):
                self.kv[(row.seq.pages[pos // self.ps], pos % self.ps)] = tuple(tokens[: pos + 1])
        for row in plan.rows:
            tokens = row.seq.token_ids
            for pos in range(row.start + row.length):
                slot = (row.seq.pages[pos // self.ps], pos % self.ps)
                assert self.kv.get(slot) == tuple(tokens[: pos + 1]), f"{row.seq.request_id} reads a stale slot {slot}"
        for s in self.sched.running:
            tokens = s.token_ids
            for i, h in enumerate(prefix_hashes(tokens, self.ps)):
                self.prefix_of_hash[h] = tuple(tokens[: (i + 1) * self.ps])
        for h, prefix in self.prefix_of_hash.items():
            page = self.alloc.cached_page(h)
            if page is not None:
                for slot in range(self.ps):
                    want = prefix[: len(prefix) - self.ps + slot + 1]
                    assert self.kv.get((page, slot)) == want, f"cached page {page} holds the wrong prefix"

    def check_state(self) -> None:
        sched, alloc = self.sched, self.alloc
        counts = [0] * alloc.num_pages
        for s in self.live:
            assert len(set(s.pages)) == len(s.pages), "a sequence holds a page twice"
            assert SCRATCH_PAGE not in s.pages
            for page in s.pages:
                counts[page] += 1
            if s.status is Status.RUNNING:
                assert len(s.pages) == cdiv(s.num_computed, self.ps)
                assert 1 <= s.num_pending, "a running sequence has nothing to compute"
            else:
                assert s.status is Status.WAITING
                assert s.pages == [] and s.num_computed == 0
        for s in self.done:
            assert s.status is Status.FINISHED and s.pages == []
        assert [alloc.ref_count(p) for p in range(alloc.num_pages)] == counts
        assert alloc.num_free == sum(1 for c in counts[1:] if c == 0)
        assert sorted(map(id, sched.running)) == sorted(id(s) for s in self.live if s.status is Status.RUNNING)
        assert sorted(map(id, sched.waiting)) == sorted(id(s) for s in self.live if s.status is Status.WAITING)
        assert len(sched.running) <= sched.config.max_num_seqs

    def check_all_free(self) -> None:
        assert not self.sched.has_work()
        assert self.alloc.num_free == self.alloc.num_pages - 1
        assert all(self.alloc.ref_count(p) == 0 for p in range(self.alloc.num_pages))


# ---- configuration ----


@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens", "prefill_chunk", "max_model_len"])
def test_config_fields_must_be_positive(field):
    values = dict(max_num_seqs=1, max_num_batched_tokens=1, prefill_chunk=1, max_model_len=1)
    values[field] = 0
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**values)


def test_pool_must_hold_one_longest_sequence():
    make(num_pages=17, page_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="num_pages"):
        make(num_pages=16, page_size=4, max_model_len=64)


# ---- one sequence ----


def test_prompt_then_decodes_then_all_pages_free():
    sched = make(page_size=4)
    sim = Sim(sched)
    a = seq("a", 10, max_tokens=3)
    sim.add(a)
    assert sched.has_work()
    plan = sim.step()
    assert rows(plan.prefill) == [("a", 0, 10)] and plan.decode == [] and plan.preempted == []
    assert plan.prefill[0].samples
    assert a.pages == [1, 2, 3] and a.num_computed == 10 and len(a.output_ids) == 1
    plan = sim.step()
    assert rows(plan.decode) == [("a", 10, 1)] and plan.prefill == []
    assert a.pages == [1, 2, 3]
    plan = sim.step()
    assert rows(plan.decode) == [("a", 11, 1)]
    assert a.status is Status.FINISHED and len(a.output_ids) == 3
    assert not sched.has_work()
    sim.check_all_free()
    assert sched.num_preemptions == 0


def test_decode_allocates_a_page_when_the_last_one_is_full():
    sched = make(page_size=4)
    sim = Sim(sched)
    a = seq("a", 7, max_tokens=4)
    sim.add(a)
    sim.step()  # computes 0..6, samples token 7
    assert a.pages == [1, 2]
    sim.step()  # computes 7 (fills page 2), samples token 8
    assert a.pages == [1, 2]
    sim.step()  # computes 8: a third page
    assert a.pages == [1, 2, 3]
    sim.step()
    assert a.status is Status.FINISHED
    sim.check_all_free()


def test_row_samples_only_at_the_end_of_the_tokens():
    a = seq("a", 10)
    assert not Row(a, 0, 9).samples
    assert Row(a, 0, 10).samples and Row(a, 9, 1).samples


# ---- chunked prefill ----


def test_prompt_longer_than_the_chunk_is_split_over_steps():
    sched = make(prefill_chunk=8)
    sim = Sim(sched)
    a = seq("a", 20, max_tokens=2)
    sim.add(a)
    pages = []
    for start, length, samples in ((0, 8, False), (8, 8, False), (16, 4, True)):
        plan = sim.step()  # each chunk resumes at num_computed
        assert rows(plan.prefill) == [("a", start, length)] and plan.decode == []
        assert plan.prefill[0].samples is samples
        pages.append(list(a.pages))
    assert pages == [[1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5]]
    assert len(a.output_ids) == 1
    assert rows(sim.step().decode) == [("a", 20, 1)]
    assert a.status is Status.FINISHED
    sim.check_all_free()


def test_prompt_longer_than_the_budget_is_split_over_steps():
    sched = make(max_num_batched_tokens=10, prefill_chunk=16)
    sim = Sim(sched)
    sim.add(seq("a", 25, max_tokens=1))
    assert [rows(sim.step().prefill) for _ in range(3)] == [[("a", 0, 10)], [("a", 10, 10)], [("a", 20, 5)]]
    sim.check_all_free()


def test_a_one_token_chunk_is_a_decode_row_that_does_not_sample():
    sched = make(max_num_batched_tokens=3, prefill_chunk=16)
    sim = Sim(sched)
    a, b = seq("a", 2, max_tokens=2), seq("b", 6, max_tokens=1)
    sim.add(a, b)
    plan = sim.step()
    assert rows(plan.prefill) == [("a", 0, 2)] and rows(plan.decode) == [("b", 0, 1)]
    assert not plan.decode[0].samples
    plan = sim.step()  # a decodes; b continues with what is left
    assert rows(plan.decode) == [("a", 2, 1)] and rows(plan.prefill) == [("b", 1, 2)]
    sim.run_all()


# ---- budgets and limits ----


def test_decodes_first_then_running_prompts_then_waiting():
    sched = make(max_num_batched_tokens=12, prefill_chunk=8, page_size=4)
    sim = Sim(sched)
    a, b = seq("a", 3, max_tokens=5), seq("b", 20, max_tokens=2)
    sim.add(a, b)
    plan = sim.step()
    assert rows(plan.prefill) == [("a", 0, 3), ("b", 0, 8)]  # 11 of 12 tokens
    c = seq("c", 6, max_tokens=2)
    sim.add(c)
    plan = sim.step()
    # a decodes (1), b's next chunk (8), c gets the 3 tokens left
    assert rows(plan.decode) == [("a", 3, 1)]
    assert rows(plan.prefill) == [("b", 8, 8), ("c", 0, 3)]
    assert plan.num_tokens == 12
    plan = sim.step()
    assert rows(plan.decode) == [("a", 4, 1)]
    assert rows(plan.prefill) == [("b", 16, 4), ("c", 3, 3)]
    sim.run_all()


def test_budget_spent_on_decodes_leaves_prompts_waiting():
    sched = make(max_num_batched_tokens=2, prefill_chunk=8)
    sim = Sim(sched)
    a, b, c = seq("a", 1, max_tokens=4), seq("b", 1, max_tokens=4), seq("c", 1, max_tokens=4)
    sim.add(a, b, c)
    plan = sim.step()
    assert rows(plan.decode) == [("a", 0, 1), ("b", 0, 1)]  # one-token prompts are decode rows
    assert c.status is Status.WAITING
    plan = sim.step()
    assert rows(plan.decode) == [("a", 1, 1), ("b", 1, 1)] and plan.prefill == []
    assert c.status is Status.WAITING
    sim.run_all()


def test_oldest_decodes_win_when_the_budget_is_short():
    sched = make(max_num_batched_tokens=5, prefill_chunk=2, max_num_seqs=4)
    sim = Sim(sched)
    seqs = [seq(str(i), 2, max_tokens=3) for i in range(4)]
    sim.add(*seqs)
    plan = sim.step()
    assert rows(plan.prefill) == [("0", 0, 2), ("1", 0, 2)] and rows(plan.decode) == [("2", 0, 1)]
    plan = sim.step()
    assert rows(plan.decode) == [("0", 2, 1), ("1", 2, 1), ("2", 1, 1)]
    assert rows(plan.prefill) == [("3", 0, 2)]
    sim.run_all()


def test_max_num_seqs_bounds_the_running_set():
    sched = make(max_num_seqs=2)
    sim = Sim(sched)
    seqs = [seq(str(i), 5, max_tokens=2) for i in range(5)]
    sim.add(*seqs)
    assert rows(sim.step().prefill) == [("0", 0, 5), ("1", 0, 5)]
    assert ids(sched.waiting) == ["2", "3", "4"]
    assert rows(sim.step().decode) == [("0", 5, 1), ("1", 5, 1)]  # both finish
    assert rows(sim.step().prefill) == [("2", 0, 5), ("3", 0, 5)]
    sim.run_all()


def test_a_step_limit_below_the_budget_is_honoured():
    """While the larger programs still compile the engine passes the largest ready step size."""
    sched = make(max_num_batched_tokens=64, prefill_chunk=64)
    sim = Sim(sched)
    sim.add(*[seq(str(i), 20, max_tokens=2) for i in range(3)])
    sim.add(seq("one", 1, max_tokens=2))
    assert rows(sim.step(max_tokens=8).prefill) == [("0", 0, 8)]
    assert ids(sched.waiting) == ["1", "2", "one"]  # the queue is first come, first served
    assert rows(sim.step(max_tokens=32).prefill) == [("0", 8, 12), ("1", 0, 20)]
    plan = sim.step(max_tokens=100)  # the configured budget still bounds it
    assert rows(plan.decode) == [("0", 20, 1), ("1", 20, 1), ("one", 0, 1)]  # "one" is a decode row
    assert rows(plan.prefill) == [("2", 0, 20)]
    assert ids(sched.waiting) == []
    sim.run_all()


# ---- preemption ----


def test_newest_running_sequence_is_preempted_to_the_front_of_the_queue():
    sched = make(num_pages=5, page_size=4, max_model_len=16)  # 4 usable pages
    sim = Sim(sched)
    a, b, c = seq("a", 7, max_tokens=6, seed=1), seq("b", 7, max_tokens=4, seed=2), seq("c", 3, max_tokens=2)
    sim.add(a, b, c)
    plan = sim.step()
    assert rows(plan.prefill) == [("a", 0, 7), ("b", 0, 7)]
    assert a.pages == [1, 2] and b.pages == [3, 4] and ids(sched.waiting) == ["c"]
    plan = sim.step()  # both decode within their second page (filling it)
    assert rows(plan.decode) == [("a", 7, 1), ("b", 7, 1)] and plan.preempted == []
    b_outputs = list(b.output_ids)
    assert len(b_outputs) == 2
    plan = sim.step()  # a needs a third page: b, the newest, goes
    assert plan.preempted == [b] and rows(plan.decode) == [("a", 8, 1)] and plan.prefill == []
    assert sched.num_preemptions == 1
    assert ids(sched.waiting) == ["b", "c"] and ids(sched.running) == ["a"]
    assert b.pages == [] and b.num_computed == 0 and b.output_ids == b_outputs
    assert a.pages == [1, 2, 4]  # b's tail page went first
    assert [sched.allocator.ref_count(p) for p in (3, 4)] == [0, 1]
    # b's first page is still cached, but b cannot start again until a frees pages: no preemption by waiters.
    while a.status is not Status.FINISHED:
        plan = sim.step()
        assert plan.preempted == [] and b.status is Status.WAITING
    plan = sim.step()
    # b recomputes prompt and outputs; its first page comes from the cache, its second was a's
    assert rows(plan.prefill) == [("b", 4, 5), ("c", 0, 3)] and plan.prefill[0].samples
    assert b.pages == [3, 4, 2] and c.pages == [1]
    sim.run_all()
    assert len(b.output_ids) == 4 and b.output_ids[:2] == b_outputs
    assert sched.num_preemptions == 1


def test_preempting_a_sequence_drops_its_row_from_the_plan():
    """An older prompt's chunk preempts a newer sequence whose decode row is already planned."""
    sched = make(num_pages=5, page_size=4, prefill_chunk=4, max_model_len=16)
    sim = Sim(sched)
    a, z = seq("a", 16, max_tokens=1), seq("z", 3, max_tokens=8)
    sim.add(a, z)
    assert rows(sim.step().prefill) == [("a", 0, 4), ("z", 0, 3)]
    plan = sim.step()
    assert rows(plan.decode) == [("z", 3, 1)] and rows(plan.prefill) == [("a", 4, 4)]
    assert a.pages == [1, 3] and z.pages == [2]
    plan = sim.step()  # z's decode takes page 4, then a's chunk needs a page: z is the newest
    assert plan.preempted == [z]
    assert plan.decode == [] and rows(plan.prefill) == [("a", 8, 4)]
    assert plan.num_tokens == 4
    assert z.status is Status.WAITING and z.pages == [] and ids(sched.waiting) == ["z"]
    assert len(z.output_ids) == 2  # the dropped row produced nothing
    sim.run_all()
    assert a.status is Status.FINISHED and len(z.output_ids) == 8


def test_preemption_gives_dropped_tokens_back_to_the_budget():
    sched = make(num_pages=4, page_size=2, prefill_chunk=2, max_num_batched_tokens=4, max_model_len=6)
    sim = Sim(sched)
    a, y, z = seq("a", 6, max_tokens=1), seq("y", 1, max_tokens=5), seq("z", 1, max_tokens=5)
    sim.add(a, y, z)
    assert rows(sim.step().prefill) == [("a", 0, 2)] and ids(sched.running) == ["a", "y", "z"]
    assert a.pages == [1] and y.pages == [2] and z.pages == [3]
    plan = sim.step()  # y and z decode (2 tokens), a needs a page for its 2-token chunk: z goes
    assert plan.preempted == [z]
    assert rows(plan.decode) == [("y", 1, 1)] and rows(plan.prefill) == [("a", 2, 2)]
    sim.run_all()


def test_a_sequence_may_preempt_itself_and_the_queue_keeps_its_order():
    sched = make(num_pages=4, page_size=2, prefill_chunk=2, max_num_batched_tokens=8, max_model_len=6)
    sim = Sim(sched)
    a, b, c = seq("a", 2, max_tokens=4), seq("b", 2, max_tokens=4), seq("c", 2, max_tokens=4)
    sim.add(a, b, c)
    assert rows(sim.step().prefill) == [("a", 0, 2), ("b", 0, 2), ("c", 0, 2)]
    plan = sim.step()  # every decode needs a page; a preempts c, then b, and decodes
    assert plan.preempted == [c, b] and rows(plan.decode) == [("a", 2, 1)]
    assert ids(sched.waiting) == ["b", "c"]
    sim.run_all()


def test_waiting_sequences_never_preempt_running_ones():
    sched = make(num_pages=4, page_size=4, max_model_len=12)
    sim = Sim(sched)
    a = seq("a", 9, max_tokens=3)
    sim.add(a)
    sim.step()
    assert len(a.pages) == 3 and sched.allocator.num_free == 0
    b = seq("b", 2, max_tokens=1)
    sim.add(b)
    plan = sim.step()
    assert rows(plan.decode) == [("a", 9, 1)] and plan.preempted == [] and b.status is Status.WAITING
    assert sched.prefix_queries == 9  # b's failed admission is not counted
    sim.run_all()
    assert sched.num_preemptions == 0


def test_finish_of_a_preempted_sequence_frees_nothing_twice():
    sched = make(num_pages=5, page_size=4, max_model_len=16)
    sim = Sim(sched)
    a, b = seq("a", 7, max_tokens=6), seq("b", 7, max_tokens=6)
    sim.add(a, b)
    for _ in range(3):
        plan = sim.step()
    assert plan.preempted == [b]
    sim.abort(b)
    sched.finish(b)  # twice is harmless
    sim.run_all()


# ---- prefix cache ----


def test_second_sequence_reuses_a_three_page_prefix():
    sched = make(page_size=4)
    sim = Sim(sched)
    prompt = list(range(1, 15))  # 3 full pages and 2 tokens
    a = seq("a", prompt, max_tokens=3)
    sim.add(a)
    sim.step()
    assert a.pages == [1, 2, 3, 4]
    b = seq("b", prompt + [99], max_tokens=2)
    sim.add(b)
    plan = sim.step()
    assert rows(plan.prefill) == [("b", 12, 3)] and rows(plan.decode) == [("a", 14, 1)]
    assert b.pages[:3] == [1, 2, 3] and b.pages[3] not in a.pages and b.num_cached_prompt == 12
    assert [sched.allocator.ref_count(p) for p in (1, 2, 3, 4)] == [2, 2, 2, 1]
    assert (sched.prefix_queries, sched.prefix_hits) == (14 + 15, 12)
    sim.run_all()


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched = make(page_size=4)
    sim = Sim(sched)
    prompt = list(range(1, 13))  # exactly 3 pages
    a = seq("a", prompt, max_tokens=1)
    sim.add(a)
    sim.run_all()
    b = seq("b", prompt, max_tokens=1)
    sim.add(b)
    plan = sim.step()
    assert rows(plan.prefill) == [("b", 8, 4)]  # two pages matched, the third recomputed
    assert b.num_computed == 12 and b.num_cached_prompt == 8
    c = seq("c", prompt[:9], max_tokens=1)  # 2 pages and 1 token
    sim.add(c)
    plan = sim.step()
    assert rows(plan.decode) == [("c", 8, 1)] and c.num_cached_prompt == 8
    sim.run_all()


def test_siblings_added_together_share_pages_in_the_same_step():
    sched = make(page_size=4)
    sim = Sim(sched)
    prompt = list(range(1, 15))
    a, b, c = (seq(r, prompt, max_tokens=3, seed=i) for i, r in enumerate("abc"))
    sim.add(a, b, c)
    plan = sim.step()
    assert rows(plan.prefill) == [("a", 0, 14), ("b", 12, 2), ("c", 12, 2)]
    assert a.pages[:3] == b.pages[:3] == c.pages[:3]
    assert len({a.pages[3], b.pages[3], c.pages[3]}) == 3
    assert [sched.allocator.ref_count(p) for p in a.pages] == [3, 3, 3, 1]
    assert (sched.prefix_queries, sched.prefix_hits) == (42, 24)
    assert (a.num_cached_prompt, b.num_cached_prompt, c.num_cached_prompt) == (0, 12, 12)
    sim.run_all()


def test_siblings_share_the_first_chunk_of_a_long_prompt():
    sched = make(page_size=4, prefill_chunk=8)
    sim = Sim(sched)
    prompt = list(range(1, 21))
    a, b = seq("a", prompt, seed=1), seq("b", prompt, seed=2)
    sim.add(a, b)
    plan = sim.step()
    assert rows(plan.prefill) == [("a", 0, 8), ("b", 8, 8)]
    assert b.pages[:2] == a.pages[:2]
    sim.run_all()


def test_pages_holding_outputs_serve_the_next_turn():
    sched = make(page_size=4)
    sim = Sim(sched)
    a = seq("a", 6, max_tokens=4)
    sim.add(a)
    sim.run_all()  # 10 tokens, 9 computed: pages 0..7 (two of them outputs) are cached
    b = seq("b", a.token_ids + [5], max_tokens=1)
    sim.add(b)
    assert rows(sim.step().prefill) == [("b", 8, 3)] and b.num_cached_prompt == 8
    sim.run_all()


def test_aborting_a_sibling_keeps_the_shared_pages():
    sched = make(page_size=4)
    sim = Sim(sched)
    prompt = list(range(1, 10))
    a, b = seq("a", prompt, max_tokens=6, seed=1), seq("b", prompt, max_tokens=6, seed=2)
    sim.add(a, b)
    sim.step()
    assert b.pages[:2] == a.pages[:2] and [sched.allocator.ref_count(p) for p in a.pages] == [2, 2, 1]
    sim.abort(a)
    assert [sched.allocator.ref_count(p) for p in b.pages] == [1, 1, 1]
    assert sched.allocator.num_free == 63 - 3
    sim.run_all()


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    sched = make(page_size=4)
    sim = Sim(sched)
    prompt = list(range(1, 15))
    sim.add(seq("a", prompt, max_tokens=1))
    sim.run_all()
    assert (sched.prefix_queries, sched.prefix_hits) == (14, 0)
    b = seq("b", prompt, max_tokens=1, prompt_logprobs=2)
    sim.add(b)
    plan = sim.step()
    assert rows(plan.prefill) == [("b", 0, 14)] and b.num_cached_prompt == 0
    assert (sched.prefix_queries, sched.prefix_hits) == (14, 0)  # not looked up, not counted
    sim.run_all()
    c = seq("c", prompt + [7], max_tokens=1)  # b's pages joined the cache
    sim.add(c)
    assert rows(sim.step().prefill) == [("c", 12, 3)]
    sim.run_all()


def test_prompt_logprob_rows_read_the_prompt_one_budget_at_a_time():
    sched = make(max_num_batched_tokens=1)
    sim = Sim(sched)
    a = seq("a", 3, max_tokens=2, prompt_logprobs=0)
    sim.add(a)
    assert rows(sim.step().rows) == [("a", 0, 1)]  # position 0 predicts prompt token 1
    assert rows(sim.step().rows) == [("a", 1, 1)]
    assert rows(sim.step().rows) == [("a", 2, 1)]  # the last prompt position predicts an output
    assert rows(sim.step().rows) == [("a", 3, 1)]
    sim.check_all_free()


def test_disabled_prefix_cache_shares_nothing():
    sched = make(page_size=4, caching=False)
    sim = Sim(sched)
    prompt = list(range(1, 15))
    a, b = seq("a", prompt, seed=1), seq("b", prompt, seed=2)
    sim.add(a, b)
    plan = sim.step()
    assert rows(plan.prefill) == [("a", 0, 14), ("b", 0, 14)]
    assert not set(a.pages) & set(b.pages)
    assert (sched.prefix_queries, sched.prefix_hits) == (0, 0)
    sim.run_all()


def test_counters_count_each_request_once_at_first_admission():
    sched = make(num_pages=5, page_size=4, max_model_len=16)
    sim = Sim(sched)
    prompt = list(range(1, 8))
    sim.add(seq("warm", prompt, max_tokens=1))
    sim.run_all()
    assert (sched.prefix_queries, sched.prefix_hits) == (7, 0)
    a, b = seq("a", prompt, max_tokens=6, seed=1), seq("b", prompt, max_tokens=6, seed=2)
    sim.add(a, b)
    sim.step()
    assert (sched.prefix_queries, sched.prefix_hits) == (21, 8)
    assert (a.num_cached_prompt, b.num_cached_prompt) == (4, 4)
    while not sched.num_preemptions:
        sim.step()
    sim.run_all()  # b is recomputed, partly from the cache, and not counted again
    assert (sched.prefix_queries, sched.prefix_hits) == (21, 8)
    assert b.num_cached_prompt == 4


def test_freed_sequence_tail_is_evicted_before_its_prefix():
    sched = make(num_pages=7, page_size=4, max_model_len=24)  # 6 usable pages
    sim = Sim(sched)
    a = seq("a", list(range(1, 17)), max_tokens=1)  # 4 full pages
    sim.add(a)
    sim.run_all()
    assert a.pages == [] and sched.allocator.num_free == 6
    b = seq("b", list(range(50, 61)), max_tokens=2)  # 3 pages: the 2 unused ones, then a's last page
    sim.add(b)
    sim.step()
    assert b.pages == [5, 6, 4]
    sim.run_all()
    c = seq("c", list(range(1, 17)) + [0], max_tokens=2)  # a's first 3 pages are still cached
    sim.add(c)
    plan = sim.step()
    assert rows(plan.prefill) == [("c", 12, 5)] and c.pages == [1, 2, 3, 4, 6]  # b's tail pages go next
    sim.run_all()


def test_lru_prefers_recently_freed_prefixes():
    sched = make(num_pages=9, page_size=4, max_model_len=32)  # 8 usable pages
    sim = Sim(sched)
    old, new = list(range(1, 13)), list(range(31, 43))
    sim.add(seq("old", old, max_tokens=1))
    sim.run_all()
    sim.add(seq("new", new, max_tokens=1))
    sim.run_all()
    # 2 never-used pages left, then old's 3 pages, then new's 3: a 5-page prompt evicts all of old.
    sim.add(seq("big", list(range(200, 220)), max_tokens=1))
    sim.run_all()
    assert sched.prefix_hits == 0
    new2, old2 = seq("new2", new + [0], max_tokens=1), seq("old2", old + [0], max_tokens=1)
    for s in (new2, old2):
        sim.add(s)
        sim.run_all()
    assert (new2.num_cached_prompt, old2.num_cached_prompt) == (12, 0)  # old's pages were evicted first


# ---- aborts ----


def test_abort_waiting_and_running_sequences():
    sched = make(max_num_seqs=1)
    sim = Sim(sched)
    a, b = seq("a", 9, max_tokens=10), seq("b", 9, max_tokens=10)
    sim.add(a, b)
    sim.step()
    sim.abort(b)  # waiting
    assert b.status is Status.FINISHED and ids(sched.waiting) == []
    sim.abort(a)  # running
    assert not sched.has_work()
    sim.check_all_free()
    plan = sched.schedule()
    assert plan.rows == [] and plan.preempted == [] and plan.num_tokens == 0


# ---- stress ----


def random_run(seed: int) -> Sim:
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4])
    max_model_len = rng.choice([8, 16, 24])
    pages_per_seq = cdiv(max_model_len, page_size)
    max_num_seqs = rng.randint(1, 6)
    sched = make(
        num_pages=1 + pages_per_seq + rng.randint(0, 2 * pages_per_seq),
        page_size=page_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=rng.randint(max_num_seqs, 24),
        prefill_chunk=rng.randint(1, 12),
        max_model_len=max_model_len,
        caching=rng.random() < 0.85,
    )
    sim = Sim(sched, rng, eos_rate=0.05)
    system = [[rng.randrange(5) for _ in range(rng.randint(1, 10))] for _ in range(3)]
    count = 0

    def arrive():
        nonlocal count
        prompt = rng.choice(system + [[]]) + [rng.randrange(5) for _ in range(rng.randint(0, 6))]
        prompt = (prompt or [rng.randrange(5)])[: max_model_len - 1]
        max_tokens = rng.randint(1, max_model_len - len(prompt))
        logprobs = 1 if rng.random() < 0.1 else None
        group = [seq(f"{count}.{i}", prompt, max_tokens, seed=rng.randrange(1 << 16), prompt_logprobs=logprobs)
                 for i in range(rng.choice([1, 1, 1, 2, 3]))]
        count += 1
        sim.add(*group)

    for _ in range(rng.randint(1, 8)):
        arrive()
    for _ in range(400):
        if not sched.has_work():
            break
        if count < 25 and rng.random() < 0.3:
            arrive()
        if sim.live and rng.random() < 0.04:
            sim.abort(rng.choice(sim.live))
        sim.step(rng.choice([None, None, rng.randint(1, 24)]))  # sometimes a smaller step is all that is ready
    sim.run_all(max_steps=sim.steps + 2000)
    return sim


def test_random_runs_keep_invariants_and_free_every_page():
    preemptions = shared = 0
    for seed in range(60):
        sim = random_run(seed)
        preemptions += sim.sched.num_preemptions
        shared += sim.sched.prefix_hits
        assert len(sim.done) >= 1
    assert preemptions > 20 and shared > 100  # the runs do exercise preemption and prefix reuse


def test_a_sequence_that_outgrows_longropes_short_factors_is_recomputed_once_with_the_long_ones():
    """long_rope_from 12 (Phi-3's longrope): a 10-token prompt runs with the short factors until its
    13th token is to be computed; then it is requeued, its pages freed, and recomputed whole with
    the long ones (as transformers' generate recomputes its cache), not counted as a preemption. A
    14-token prompt runs long from its first step. Pages computed long hash apart from short ones,
    so neither kind is found by the other's prefix lookup."""
    sched = Scheduler(SchedulerConfig(8, 64, 16, 64, long_rope_from=12), PageAllocator(64, 4, True))
    sim = Sim(sched)
    a, b = seq("a", 10, max_tokens=6), seq("b", 14, max_tokens=2)
    sim.add(a)
    assert rows(sim.step().prefill) == [("a", 0, 10)] and not a.long_rope
    assert rows(sim.step().decode) == [("a", 10, 1)]
    assert rows(sim.step().decode) == [("a", 11, 1)] and not a.long_rope and a.num_tokens == 13
    plan = sim.step()
    assert plan.rows == [] and plan.preempted == [a] and a.long_rope and a.status is Status.WAITING
    sim.add(b)
    plan = sim.step()
    assert rows(plan.prefill) == [("a", 0, 13), ("b", 0, 14)] and a.long_rope and b.long_rope
    assert a.page_hashes[0] != prefix_hashes(a.token_ids[:4], 4)[0]
    assert sched.num_preemptions == 0
    while sched.has_work():
        sim.step()
    sim.check_all_free()
