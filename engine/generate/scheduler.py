"""Continuous batching: which sequences run in the next step, and how many tokens each. Pure Python.

Each sequence knows how many of its tokens are already in the KV cache (`num_computed`). A step
spends a token budget: first one token for every decoding sequence, then chunks of sequences still
reading their prompt, then new sequences from the waiting queue (chunked prefill), all in one ragged
batch. A row whose chunk reaches the end of the sequence's tokens samples the next token.

With speculative decoding (engine.generate.speculation) a decoding row may also carry guessed
tokens after its own, as the budget allows; its pages are reserved for them too. Guesses are not
the sequence's tokens: the engine appends those the step confirms.

A sequence with a LoRA adapter is admitted only when its adapter has a device slot (or one can be
given to it: engine.generate.adapters); the plan lists the adapters to load before the step runs.
Others behind it in the queue may go first. Its pages' prefix hashes start from its adapter's, so
it shares cached pages only with sequences of the same adapter.

When a running sequence needs a page and none is free, the newest running sequence is preempted:
its pages are freed, any row it already had in the plan is dropped, and it goes back to the front
of the queue, to be recomputed (prompt and output so far) later. Waiting sequences never preempt
running ones, and none is admitted in a step that preempted.

Full pages are offered to the prefix cache when the plan that fills them is final (so a sibling
admitted in the same step can share them), never for a row that was dropped, and only once every
token in them is known (see `Sequence.tokens_in_flight`).

With async scheduling the engine plans a step while the previous one still runs: a sequence's
last output token may be a placeholder (`PENDING_TOKEN`) whose value the device fills in. A
sequence whose pending tokens already reach its length limit is not planned again.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from typing import TYPE_CHECKING, Optional

from engine.generate.adapters import Adapter, AdapterSlots
from engine.generate.pages import PageAllocator, prefix_hashes
from engine.generate.request import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from engine.generate.grammar import GrammarState

PENDING_TOKEN = -1
"""Placeholder in `Sequence.output_ids` for a token a step still in flight is sampling."""


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
    tokens_in_flight: int = 0
    """Output tokens sampled by steps still running: the last ones of `output_ids`, each
    `PENDING_TOKEN` until the step's results arrive."""
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
    scheduled_time: Optional[float] = None
    """When a step first ran a row of the sequence (time.time(); the engine sets it)."""
    prompt_logprobs: list[Optional[TokenLogprob]] = dataclasses.field(default_factory=list)
    grammar: Optional[GrammarState] = None
    """Where the output stands in the request's grammar (structured output), or None."""
    adapter: Optional[Adapter] = None
    """The LoRA adapter the request runs with (None: the base model)."""
    adapter_slot: int = -1
    """The device slot of `adapter` while the sequence runs (-1: none)."""
    image_slots: list[int] = dataclasses.field(default_factory=list)
    """The image slots (engine.generate.images) the prompt's images hold until the sequence ends."""
    long_rope: bool = False
    """Whether the sequence runs with longrope's long factors (SchedulerConfig.long_rope_from)."""

    @property
    def hash_root(self) -> int:
        """The prefix hash before the first page: the base model's, or one per adapter; pages of
        longrope's long factors apart from the short ones'."""
        root = 0 if self.adapter is None else hash(("lora", self.adapter.uid))
        return hash(("long_rope", root)) if self.long_rope else root

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_known_tokens(self) -> int:
        return self.num_tokens - self.tokens_in_flight

    def ends_by_length(self, num_outputs: int, max_model_len: int) -> bool:
        """Whether the sequence ends by length once it has `num_outputs` output tokens."""
        return num_outputs >= self.params.max_tokens or len(self.prompt_ids) + num_outputs >= max_model_len

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed


@dataclasses.dataclass
class Row:
    """One sequence's work in a step: tokens [start, start + length) of `seq.token_ids`, then its
    guesses `drafts` (a decoding row with speculative decoding)."""

    seq: Sequence
    start: int
    length: int
    drafts: list[int] = dataclasses.field(default_factory=list)
    samples: bool = dataclasses.field(init=False)
    """Whether this step produces the sequence's next token (the row reaches the end of the
    sequence's tokens). Fixed when the row is made, so it still holds after the token is appended."""

    def __post_init__(self):
        self.samples = self.start + self.length == self.seq.num_tokens

    @property
    def num_tokens(self) -> int:
        """Token slots the row takes in the step: its own tokens and its guesses."""
        return self.length + len(self.drafts)

    @property
    def num_samples(self) -> int:
        """Sampling slots of the row: one after its last token and one after each guess."""
        return 1 + len(self.drafts)


@dataclasses.dataclass
class Plan:
    decode: list[Row]
    """Rows of one token each."""
    prefill: list[Row]
    """Rows of several tokens (at most the prefill chunk)."""
    preempted: list[Sequence]
    """Sequences preempted while planning; none of them has a row in this plan."""
    loads: list[tuple[int, Adapter]] = dataclasses.field(default_factory=list)
    """(slot, adapter) to load into the devices' LoRA slots before the step runs."""

    @property
    def rows(self) -> list[Row]:
        return self.decode + self.prefill

    @property
    def num_tokens(self) -> int:
        return sum(row.num_tokens for row in self.rows)

    @property
    def num_samples(self) -> int:
        return sum(row.num_samples for row in self.rows)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    """Sequences in one step at most (running set size)."""
    max_num_batched_tokens: int
    """Token budget of one step."""
    prefill_chunk: int
    """Tokens of one row at most (a prompt longer than this takes several steps)."""
    max_model_len: int
    """Tokens (prompt + output) of one sequence at most."""
    long_rope_from: Optional[int] = None
    """longrope: a sequence longer than this runs with the long factors, its cache computed with
    them (ModelInfo.long_rope_from); None: one RoPE."""

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, adapters: Optional[AdapterSlots] = None):
        pages_per_seq = -(-config.max_model_len // allocator.page_size)
        if pages_per_seq > allocator.num_pages - 1:
            # Otherwise a long sequence preempts itself forever.
            raise ValueError(
                f"{allocator.num_pages - 1} KV pages of {allocator.page_size} tokens cannot hold one sequence of "
                f"max_model_len={config.max_model_len} tokens; raise num_pages to at least {pages_per_seq + 1} "
                "or lower max_model_len"
            )
        self.config = config
        self.allocator = allocator
        self.adapters = adapters
        """The devices' LoRA slots (None: the engine serves no adapters)."""
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
            self._unpin_adapter(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.allocator.free(seq.pages)
        seq.pages = []
        seq.status = Status.FINISHED

    def schedule(self, max_tokens: Optional[int] = None, drafts: Optional[dict[str, list[int]]] = None) -> Plan:
        """The next step's rows. `max_tokens`: a lower token budget for this step than the
        configured one (the largest step the device side can run right now). `drafts`: guesses
        for decoding sequences, by request id (speculative decoding), taken as the budget allows."""
        plan = Plan(decode=[], prefill=[], preempted=[])
        limit = self.config.max_num_batched_tokens
        if max_tokens is not None:
            limit = min(max_tokens, limit)
        budget = self._schedule_running(plan, limit, drafts or {})
        for row in plan.rows:  # final now: no row of this plan can be dropped any more
            self._register_full_pages(row.seq, row.start + row.length)
        if not plan.preempted:
            self._admit_waiting(plan, budget)
        return plan

    def reserve_ahead(self, seq: Sequence, length: int) -> None:
        """Give a running sequence the pages for its next `length` token slots now, where they are
        free (never by preempting): a draft model writes its guesses' keys and values before the
        step that checks them is planned. The step's row then finds them allocated."""
        needed = self._pages_needed(seq, length)
        if needed and self.allocator.can_allocate(needed):
            seq.pages += self.allocator.allocate(needed)

    # ---- internals ----

    def _schedule_running(self, plan: Plan, limit: int, drafts: dict[str, list[int]]) -> int:
        """Decodes first (one token each, and their guesses while the budget lasts), then running
        prompts' chunks, oldest first within each, within `limit` tokens. Returns the budget left."""
        budget = limit
        for decoding in (True, False):
            for seq in [s for s in self.running if (s.num_pending == 1) == decoding]:
                if seq.status is not Status.RUNNING or budget == 0 or self._at_length_limit(seq):
                    continue
                if self._take_long_rope(seq):  # recomputed with the long factors, as transformers does
                    self._requeue(seq, plan)
                    budget = limit - plan.num_tokens
                    continue
                length = min(seq.num_pending, self.config.prefill_chunk, budget)
                guesses = drafts.get(seq.request_id, [])[: budget - length] if decoding else []
                num_preempted = len(plan.preempted)
                reserved = self._reserve_running(seq, length + len(guesses), plan)
                if len(plan.preempted) > num_preempted:  # victims' rows were dropped: their tokens are back
                    budget = limit - plan.num_tokens
                if reserved:
                    self._add_row(plan, Row(seq, seq.num_computed, length, guesses))
                    budget -= length + len(guesses)
        return budget

    def _admit_waiting(self, plan: Plan, budget: int) -> None:
        index = 0
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[index]
            if seq.adapter is not None and not self.adapters.can_acquire(seq.adapter):
                index += 1  # its adapter waits for a slot; the sequences behind it may go
                continue
            fresh = not seq.pages
            if fresh:
                self._take_long_rope(seq)
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
                if self._uses_prefix_cache(seq):
                    self.prefix_queries += seq.num_tokens
                    self.prefix_hits += seq.num_computed
            del self.waiting[index]
            self._pin_adapter(seq, plan)
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._add_row(plan, Row(seq, seq.num_computed, length))
            self._register_full_pages(seq, seq.num_computed + length)  # an n>1 sibling may match them next
            budget -= length

    def _take_long_rope(self, seq: Sequence) -> bool:
        """Switch `seq` to longrope's long factors if it has outgrown the short ones (its page
        hashes then start from another root); whether it switched now."""
        limit = self.config.long_rope_from
        if limit is None or seq.long_rope or seq.num_tokens <= limit:
            return False
        seq.long_rope, seq.page_hashes = True, []
        return True

    def _at_length_limit(self, seq: Sequence) -> bool:
        """Whether the output tokens already planned (some still in flight) end the sequence."""
        return bool(seq.output_ids) and seq.ends_by_length(len(seq.output_ids), self.config.max_model_len)

    def _match_prefix(self, seq: Sequence) -> None:
        """Start `seq` from the longest cached prefix, keeping at least one token to compute (its
        logits produce the next token). Prompt logprobs need every prompt position computed."""
        if self._uses_prefix_cache(seq):
            usable_pages = (seq.num_tokens - 1) // self.page_size
            seq.pages = self.allocator.match_prefix(self._hashes(seq, usable_pages))
            seq.num_registered_pages = len(seq.pages)
            seq.num_computed = len(seq.pages) * self.page_size

    def _uses_prefix_cache(self, seq: Sequence) -> bool:
        return self.allocator.enable_prefix_caching and seq.params.prompt_logprobs is None

    def _reserve_running(self, seq: Sequence, length: int, plan: Plan) -> bool:
        """Make room for `length` more token slots of a running sequence, preempting the newest running
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
        """Free all of `seq`'s pages and requeue it at the front; drop its row if it has one."""
        self._requeue(seq, plan)
        self.num_preemptions += 1

    def _requeue(self, seq: Sequence, plan: Plan) -> None:
        plan.decode = [row for row in plan.decode if row.seq is not seq]
        plan.prefill = [row for row in plan.prefill if row.seq is not seq]
        self.running.remove(seq)
        self._unpin_adapter(seq)
        self.allocator.free(seq.pages)
        seq.pages, seq.num_computed, seq.num_registered_pages = [], 0, 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)

    def _pin_adapter(self, seq: Sequence, plan: Plan) -> None:
        """Give a sequence being admitted its adapter's slot; a slot newly given is loaded first."""
        if seq.adapter is None:
            return
        seq.adapter_slot, load = self.adapters.acquire(seq.adapter)
        if load:
            plan.loads.append((seq.adapter_slot, seq.adapter))

    def _unpin_adapter(self, seq: Sequence) -> None:
        if seq.adapter is not None:
            self.adapters.release(seq.adapter)
            seq.adapter_slot = -1

    def _pages_needed(self, seq: Sequence, length: int) -> int:
        total = -(-(seq.num_computed + length) // self.page_size)
        return max(0, total - len(seq.pages))

    @staticmethod
    def _add_row(plan: Plan, row: Row) -> None:
        """Rows of one token go first (decodes), rows of several (prompts) after them."""
        (plan.decode if row.length == 1 else plan.prefill).append(row)

    def _register_full_pages(self, seq: Sequence, end: int) -> None:
        """Offer the pages this step fills to the prefix cache once the row is final. Within a
        step every layer writes all new keys/values before any attention reads them, so a
        sequence admitted later in the same step (an n>1 sibling) may already read these pages."""
        if not self.allocator.enable_prefix_caching:
            return
        full = min(end, seq.num_known_tokens) // self.page_size  # a pending token has no hash yet
        if full <= seq.num_registered_pages:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_registered_pages, full):
            self.allocator.register(seq.pages[i], hashes[i])
        seq.num_registered_pages = max(seq.num_registered_pages, full)

    def _hashes(self, seq: Sequence, num_pages: int) -> list[int]:
        """Prefix hashes of the first `num_pages` full pages, extending the sequence's memo."""
        known = len(seq.page_hashes)
        if num_pages > known:
            parent = seq.page_hashes[-1] if known else seq.hash_root
            start = known * self.page_size
            tokens = seq.token_ids[start : num_pages * self.page_size]
            seq.page_hashes += prefix_hashes(tokens, self.page_size, parent)
        return seq.page_hashes[:num_pages]
