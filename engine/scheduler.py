"""Continuous batching: which sequences run in the next step, and how many tokens each. Pure Python.

Each sequence knows how many of its tokens are already in the KV cache (`num_computed`). A step
spends a token budget: first one token for every decoding sequence, then chunks of sequences still
reading their prompt, then new sequences from the waiting queue (chunked prefill), all in one ragged
batch. A row whose chunk reaches the end of the sequence's tokens samples the next token.

When a running sequence needs a page and none is free, the newest running sequence is preempted:
its pages are freed and it goes back to the front of the queue, to be recomputed (prompt and output
so far) later. Waiting sequences never preempt running ones.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from typing import Optional

from engine.pages import PageAllocator, prefix_hashes
from engine.request import SamplingParams, TokenLogprob


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request's state inside the engine."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    """Tokens of `token_ids` whose keys and values are in the cache (pages)."""
    page_hashes: list[int] = dataclasses.field(default_factory=list)
    """Prefix hash of each full page of `token_ids` computed so far (see pages.prefix_hashes)."""
    num_registered_pages: int = 0
    """Leading pages already offered to the prefix cache."""
    num_cached_prompt: int = 0
    """Prompt tokens found in the prefix cache at first admission."""
    status: Status = Status.WAITING
    admitted: bool = False
    """Whether the sequence ever ran (its prefix-cache lookup is counted once)."""
    sent_first: bool = False
    """Whether the first delta (with prompt bookkeeping) went out."""
    prompt_logprobs: list[Optional[TokenLogprob]] = dataclasses.field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.num_computed < len(self.prompt_ids)


@dataclasses.dataclass
class Row:
    """One sequence's work in a step: tokens [start, start + length) of `seq.token_ids`."""

    seq: Sequence
    start: int
    length: int

    @property
    def samples(self) -> bool:
        """Whether this step produces the sequence's next token."""
        return self.start + self.length == self.seq.num_tokens


@dataclasses.dataclass
class Plan:
    decode: list[Row]
    """Rows of one token each."""
    prefill: list[Row]
    """Rows of several tokens (at most the prefill chunk)."""
    preempted: list[Sequence]

    @property
    def rows(self) -> list[Row]:
        return self.decode + self.prefill

    @property
    def num_tokens(self) -> int:
        return sum(row.length for row in self.rows)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    """Sequences in one step at most (running set size)."""
    max_num_batched_tokens: int
    """Token budget of one step."""
    prefill_chunk: int
    """Tokens of one prefill row at most."""
    max_prefill_rows: int
    """Prefill rows in one step at most."""
    max_model_len: int
    """Tokens (prompt + output) of one sequence at most."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator):
        self.config = config
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache (first admission only)
        self.prefix_hits = 0  # of those, tokens found

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (finished or aborted) and return its pages."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.allocator.free(seq.pages)
        seq.pages = []
        seq.status = Status.FINISHED

    def schedule(self) -> Plan:
        plan = Plan(decode=[], prefill=[], preempted=[])
        budget = self.config.max_num_batched_tokens
        # Decodes first (one token each), then running prompts, oldest first within each.
        for decoding in (True, False):
            for seq in [s for s in self.running if (s.num_pending == 1) == decoding]:
                if seq.status is not Status.RUNNING or budget == 0:
                    continue
                if not decoding and len(plan.prefill) == self.config.max_prefill_rows:
                    break
                length = min(seq.num_pending, self.config.prefill_chunk, budget)
                if self._reserve_running(seq, length, plan):
                    self._add_row(plan, Row(seq, seq.num_computed, length))
                    budget -= length
        self._admit_waiting(plan, budget)
        return plan

    # ---- internals ----

    def _admit_waiting(self, plan: Plan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending > 1 and len(plan.prefill) == self.config.max_prefill_rows:
                return
            fresh = not seq.pages
            if fresh:
                self._match_prefix(seq)
            length = min(seq.num_pending, self.config.prefill_chunk, budget)
            needed = self._pages_needed(seq, length)
            if not self.allocator.can_allocate(needed):
                if fresh:  # give the cache hits back; try again next step
                    self.allocator.free(seq.pages)
                    seq.pages, seq.num_computed, seq.num_registered_pages = [], 0, 0
                return
            seq.pages += self.allocator.allocate(needed)
            if not seq.admitted:
                seq.admitted = True
                seq.num_cached_prompt = seq.num_computed
                self.prefix_queries += seq.num_tokens
                self.prefix_hits += seq.num_computed
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._add_row(plan, Row(seq, seq.num_computed, length))
            budget -= length

    def _match_prefix(self, seq: Sequence) -> None:
        """Start `seq` from the longest cached prefix, keeping at least one token to compute (its
        logits produce the next token). Prompt logprobs need every prompt position computed."""
        if seq.params.prompt_logprobs is None:
            usable_pages = (seq.num_tokens - 1) // self.page_size
            seq.pages = self.allocator.match_prefix(self._hashes(seq, usable_pages))
            seq.num_registered_pages = len(seq.pages)
            seq.num_computed = len(seq.pages) * self.page_size

    def _reserve_running(self, seq: Sequence, length: int, plan: Plan) -> bool:
        """Make room for `length` more tokens of a running sequence, preempting the newest running
        sequences as needed. False if `seq` itself had to be preempted."""
        needed = self._pages_needed(seq, length)
        while not self.allocator.can_allocate(needed):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is seq:
                return False
        seq.pages += self.allocator.allocate(needed)
        return True

    def _preempt(self, seq: Sequence, plan: Plan) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.pages)
        seq.pages, seq.num_computed, seq.num_registered_pages = [], 0, 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
        self.num_preemptions += 1

    def _pages_needed(self, seq: Sequence, length: int) -> int:
        total = -(-(seq.num_computed + length) // self.page_size)
        return max(0, total - len(seq.pages))

    def _add_row(self, plan: Plan, row: Row) -> None:
        (plan.decode if row.length == 1 and not row.seq.wants_prompt_logprobs else plan.prefill).append(row)
        self._register_full_pages(row.seq, row.start + row.length)

    def _register_full_pages(self, seq: Sequence, end: int) -> None:
        """Offer the pages this step fills to the prefix cache right away. Within a step every
        layer writes all new keys/values before any attention reads them, so a sequence admitted
        later in the same step (an n>1 sibling) may already read these pages."""
        full = end // self.page_size
        hashes = self._hashes(seq, full)
        for i in range(seq.num_registered_pages, full):
            self.allocator.register(seq.pages[i], hashes[i])
        seq.num_registered_pages = max(seq.num_registered_pages, full)

    def _hashes(self, seq: Sequence, num_pages: int) -> list[int]:
        """Prefix hashes of the first `num_pages` full pages, extending the sequence's memo."""
        known = len(seq.page_hashes)
        if num_pages > known:
            parent = seq.page_hashes[-1] if known else 0
            start = known * self.page_size
            tokens = seq.token_ids[start : num_pages * self.page_size]
            seq.page_hashes += prefix_hashes(tokens, self.page_size, parent)
        return seq.page_hashes[:num_pages]
