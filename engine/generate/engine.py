"""The engine: add requests, abort them, and step.

One request's path: `add_request` validates it and queues a `Sequence`; each `step()` asks the
scheduler for a plan (which sequences run, how many tokens each), turns it into a step plan (plain
arrays, engine.generate.step_plan), has the executor launch it, and returns one `TokenDelta` per
sequence that produced a token (plus one per aborted request). A finished or aborted sequence
returns all its pages at once.

Async scheduling (the default): `step()` launches step N+1 before it waits for step N, so the host
work of one step runs while the device computes the previous one. Launching advances each row at
once (`num_computed`, a `PENDING_TOKEN` per sampled token); fetching fills the tokens in and ends
sequences. A sequence that ends at N may already have a row in N+1: that row's result is dropped.
This is safe for the KV pages such a sequence frees: steps run in launch order on the device, so
whatever N+1 writes into them lands before any later step that reuses them.

Structured output (a request with a grammar, engine.generate.grammar): the bitmask a constrained row
samples under depends on every token before it, including the one step N is still sampling. So
step N+1 is launched in two parts: its forward pass first (as any step, reading N's tokens on the
device), then, once N is fetched and the grammars have taken its tokens, the masks are computed
and N+1's sampling is launched. The masks overlap N+1's forward pass; what waits is the sampling.

Speculative decoding (`speculative`, engine.generate.speculation): decoding rows carry guessed tokens
(prompt lookup's, on the host, or a draft model's, from the executor), and the step samples after
each; the engine keeps the guesses the model agrees with. A step with guesses is finished before
the next is planned (its rows' lengths depend on what was kept), and guesses are made only from
tokens the host has: while a step is in flight, the engine waits for it first only when guesses
are likely (prompt lookup: a sequence's known tokens already repeat; a draft model: always while
a row has room for one); otherwise steps keep overlapping.

LoRA adapters (`max_loras`): `add_adapter` reads an adapter into host memory under a name (any
thread); a request that names it runs with it. The scheduler admits it once its adapter has one of
the devices' slots (engine.generate.adapters), and the step that first reads a newly given slot loads
the adapter into it first.

Images (a vision-language model, engine.generate.images): a request's images take device slots, their
features computed into slots no other image has, before it is queued for the scheduler; while
running requests hold the slots its images need, it waits (first come, first served) and is
placed at the step after they end.

Single-threaded by design: `AsyncEngine` drives it from one background thread.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from typing import Any, Optional

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.generate.adapters import Adapter, AdapterSlots
from engine.generate.executor.base import make_executor
from engine.generate.grammar import GrammarCompiler
from engine.generate.images import ImageInput, ImageSlots
from engine.generate.pages import PageAllocator
from engine.generate.request import (
    FinishReason,
    SamplingParams,
    TokenDelta,
    TokenLogprob,
    check_request,
)
from engine.generate.scheduler import (
    PENDING_TOKEN,
    Plan,
    Row,
    Scheduler,
    SchedulerConfig,
    Sequence,
    Status,
)
from engine.generate.speculation import (
    NgramProposer,
    draft_limit,
    kept_tokens,
    share_slots,
)
from engine.generate.step_plan import RowSlots, StepOutput, StepPlanner, draft_inputs
from engine.stats import EngineStats

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LaunchedStep:
    """A step on the devices, with what maps its outputs back to the plan's rows."""

    plan: Plan
    slots: RowSlots
    handle: Any
    """What the executor returned from `launch` (a device step, or the workers' calls)."""
    masks_pending: bool = False
    """Its sampling waits for its grammars' masks (`LLMEngine._sample_constrained`)."""

    @property
    def speculative(self) -> bool:
        """Whether a row carries guesses (the next step needs its results first)."""
        return any(row.drafts for row in self.plan.rows)


@dataclasses.dataclass(frozen=True)
class RowResult:
    """What one row of a step produced (`tokens` are meaningful only when the row samples): the
    token sampled in each of its sampling slots (one, or 1 + its guesses)."""

    tokens: list[int]
    logprobs: Optional[list[TokenLogprob]]
    prompt_logprobs: list[TokenLogprob]
    """For rows of a sequence that asked for prompt logprobs: one per prompt token this row
    predicts (tokens start+1 .. of the prompt)."""


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.executor = make_executor(config)
        self.max_model_len = self.executor.max_model_len
        self.allocator = PageAllocator(self.executor.num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                prefill_chunk=config.prefill_chunk or config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
            ),
            self.allocator,
            AdapterSlots(config.max_loras) if config.max_loras else None,
        )
        self._adapters: dict[str, Adapter] = {}
        """Adapters by name (written by any thread, one assignment at a time)."""
        self.eos_token_ids = frozenset(self.executor.info.eos_token_ids)
        self.vocab_size = self.executor.vocab_size
        self.grammars = GrammarCompiler(config.model, self.vocab_size, tuple(sorted(self.eos_token_ids)))
        self.planner = StepPlanner(self.executor.buckets, self.vocab_size, self.executor.info.eos_token_ids,
                                   self.grammars)
        self._sequences: dict[str, Sequence] = {}
        self._aborted: list[str] = []
        self._in_flight: Optional[LaunchedStep] = None
        self._awaiting_images: dict[str, tuple[Sequence, tuple[ImageInput, ...]]] = {}
        """Requests with images waiting for image slots (in arrival order), not yet scheduled."""
        self._seeds = random.Random(config.seed)
        layout = self.executor.image_layout
        self.image_token_id: Optional[int] = None if layout is None else layout[0]
        """The prompt's image placeholder token (a model that takes images), else None."""
        self.images = None if layout is None else ImageSlots(layout[2], layout[1], self.vocab_size)
        """Which image each device slot holds (engine.generate.images), or None: a text-only model."""
        if self.images is not None and config.draft_model:
            raise ValueError("a draft model cannot guess after image tokens; use speculative method ngram or none "
                             "with a vision-language model")
        ngram = config.speculative is not None and config.speculative.method == "ngram"
        self.proposer = NgramProposer(config.speculative) if ngram else None
        """Prompt-lookup guesses for decoding rows (speculative decoding by n-gram), or None."""
        cap = config.speculative.max_step_tokens if config.speculative else None
        self.max_step_tokens = cap or self.executor.flat_step_tokens
        """Token slots a step's decoding rows and their guesses take at most."""
        self._num_drafts = 0  # rows that carried guesses
        self._num_draft_tokens = 0  # guesses checked
        self._num_accepted_tokens = 0  # of those, kept
        self._num_steps = 0
        self._last_batch = 0
        self._max_batch = 0
        self.warmup_seconds: Optional[float] = self.executor.warmup() if config.warmup else None
        """Seconds until the first step program was ready (the rest compile in the background)."""

    # ---- the surface ----

    def validate(self, prompt_ids: list[int], params: SamplingParams, adapter: Optional[str] = None,
                 images: tuple[ImageInput, ...] = ()) -> None:
        """Raise InvalidRequestError if this request can never be served (an invalid grammar, an
        unknown adapter, images the prompt does not place or a text-only model cannot see
        included). Thread-safe."""
        check_request(prompt_ids, params, self.vocab_size, self.max_model_len)
        self._check_images(prompt_ids, params, images)
        if adapter is not None and adapter not in self._adapters:
            raise InvalidRequestError(f"LoRA adapter {adapter!r} is not loaded; loaded: "
                                      f"{', '.join(sorted(self._adapters)) or 'none'}", "model")
        if params.grammar is not None:  # compiled once: `add_request` finds it compiled
            self.grammars.compile(params.grammar)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    adapter: Optional[str] = None, images: tuple[ImageInput, ...] = ()) -> None:
        """Queue a request; `adapter`: the name of a LoRA adapter to run it with (None: the base
        model); `images`: one per run of tokens_per_image image placeholders in the prompt, in order."""
        self.validate(prompt_ids, params, adapter, images)
        if request_id in self._sequences or request_id in self._awaiting_images:
            raise InvalidRequestError(f"request id {request_id!r} is already running", "request_id")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        seq = Sequence(request_id, list(prompt_ids), params, seed)
        seq.adapter = None if adapter is None else self._adapters[adapter]
        seq.prompt_logprobs = [None] * len(prompt_ids)
        if params.grammar is not None:
            seq.grammar = self.grammars.state(params.grammar)
        if images:
            self._awaiting_images[request_id] = (seq, images)
            self._place_awaiting()
        else:
            self._queue(seq)

    def abort(self, request_id: str) -> None:
        """Free the request's pages now; its stream ends with an `abort` delta at the next step."""
        seq = self._sequences.pop(request_id, None)
        if seq is not None:
            self._end(seq)
        if seq is not None or self._awaiting_images.pop(request_id, None) is not None:
            self._aborted.append(request_id)

    def add_adapter(self, name: str, path: str) -> None:
        """Read the PEFT LoRA adapter at `path` and serve it as `name` (replacing an adapter of that
        name; requests already running keep the one they started with). ValueError if the
        engine cannot serve it (the message says why). Any thread."""
        if self.scheduler.adapters is None:
            raise ValueError("this engine serves no LoRA adapters; set max_loras to the number to hold at once")
        from engine.formats.peft import read_adapter

        weights = read_adapter(path, self.executor.info, self.config.max_lora_rank, self.executor.lora_targets)
        self._adapters[name] = Adapter(name, weights)
        logger.info("LoRA adapter %s: rank %d on %s from %s", name, weights.rank, ", ".join(weights.targets), path)

    def remove_adapter(self, name: str) -> bool:
        """Stop serving adapter `name` (requests running with it finish with it); False if unknown."""
        return self._adapters.pop(name, None) is not None

    def adapters(self) -> list[str]:
        return sorted(self._adapters)

    def has_work(self) -> bool:
        return (bool(self._aborted) or self._in_flight is not None or self.scheduler.has_work()
                or bool(self._awaiting_images))

    def step(self) -> list[TokenDelta]:
        deltas = [TokenDelta(rid, [], finish_reason=FinishReason.ABORT) for rid in self._aborted]
        self._aborted.clear()
        self._place_awaiting()
        previous, self._in_flight = self._in_flight, None
        if previous is not None and (self._needs_host_tokens() or self._guesses_likely()):
            deltas += self._finish(previous)  # penalties count every sampled token, guesses need them: no overlap
            previous = None
        launched = self._launch(previous)
        if previous is not None:
            deltas += self._finish(previous)
        if launched is not None and launched.masks_pending:
            self._sample_constrained(launched)
        if launched is not None:
            if self.config.async_scheduling and not launched.speculative:
                self._in_flight = launched
            else:
                deltas += self._finish(launched)
        return deltas

    def heartbeat(self) -> None:
        """Raise if a host of the replica is gone (a step would fail the same way, later)."""
        self.executor.check_alive()

    def describe(self) -> dict[str, str]:
        """How this engine runs its model: attention backend, dtypes, devices, mesh, KV pool."""
        return {**self.executor.describe(), "max_model_len": str(self.max_model_len)}

    def wait_until_compiled(self, timeout: Optional[float] = None) -> bool:
        """Block until every step program is compiled (benchmarks that measure steady state); True if all are."""
        return self.executor.wait_compiled(timeout)

    def shutdown(self) -> None:
        """Release the executor's workers (several hosts); the engine cannot step after."""
        self.executor.shutdown()

    def stats(self) -> EngineStats:
        compiled, programs = self.executor.compile_progress()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self._awaiting_images),
            num_free_pages=self.allocator.num_free,
            num_pages=self.allocator.num_pages - 1,
            prefix_cache_queries=self.scheduler.prefix_queries,
            prefix_cache_hits=self.scheduler.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self._num_steps,
            last_batch_size=self._last_batch,
            max_batch_size=self._max_batch,
            max_model_len=self.max_model_len,
            compiled_programs=compiled,
            step_programs=programs,
            num_adapters=len(self._adapters),
            lora_slots_in_use=0 if self.scheduler.adapters is None else self.scheduler.adapters.pinned(),
            spec_drafts=self._num_drafts,
            spec_draft_tokens=self._num_draft_tokens,
            spec_accepted_tokens=self._num_accepted_tokens,
        )

    # ---- internals ----

    def _needs_host_tokens(self) -> bool:
        """Whether planning the next step needs every token sampled so far on the host."""
        return any(seq.params.needs_penalties for seq in self.scheduler.running)

    def _guesses_likely(self) -> bool:
        """Whether the next step would likely carry guesses, which needs the tokens in flight on
        the host first: the step has room for them, and a decoding sequence's known tokens
        already repeat (prompt lookup) or a draft model can guess for one."""
        if self.config.speculative is None:
            return False
        decoding = [seq for seq in self.scheduler.running if seq.num_pending == 1]
        if len(decoding) >= self.max_step_tokens:
            return False
        if self.proposer is None:  # a draft model guesses whatever the text
            return any(draft_limit(seq, self.max_model_len) for seq in decoding)
        return any(self.proposer.propose(seq.token_ids[: seq.num_known_tokens], 1)
                   for seq in decoding if draft_limit(seq, self.max_model_len))

    def _drafts(self, ready: list) -> dict[str, list[int]]:
        """Guesses for the decoding sequences whose every token is on the host, by request id,
        sharing the token slots `max_step_tokens` leaves beside the decoding rows' own. `ready`:
        the buckets compiled so far (a draft model's propose program takes a ready size)."""
        if self.config.speculative is None:
            return {}
        decoding = [seq for seq in self.scheduler.running if seq.num_pending == 1]
        spare = self.max_step_tokens - len(decoding)
        most = self.config.max_drafts
        limits = [(seq, 0 if seq.tokens_in_flight else min(most, draft_limit(seq, self.max_model_len)))
                  for seq in decoding]
        limits = [(seq, limit) for seq, limit in limits if limit] if spare > 0 else []
        if self.proposer is None:  # a draft guesses every row: share the slots first, then draft that many
            limits = [(seq, n) for (seq, _), n in zip(limits, share_slots([n for _, n in limits], spare)) if n]
        proposed = self._guesses(limits, ready)
        counts = share_slots([len(g) for g in proposed.values()], spare)
        return {rid: guesses[:n] for (rid, guesses), n in zip(proposed.items(), counts) if n}

    def _guesses(self, sequences: list[tuple[Sequence, int]], ready: list) -> dict[str, list[int]]:
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
        drafted = self.executor.propose(draft_inputs(self.executor.buckets, [seq for seq, _ in sequences], steps,
                                                     ready))
        return {seq.request_id: [int(t) for t in drafted[row, :limit]] for row, (seq, limit) in enumerate(sequences)}

    def _launch(self, previous: Optional[LaunchedStep]) -> Optional[LaunchedStep]:
        """Plan and dispatch the next step (None if nothing can run); advance its rows."""
        if not self.scheduler.has_work():
            return None
        ready = self.executor.ready_buckets()  # while programs compile, steps fit the ready ones
        plan = self.scheduler.schedule(max_tokens=ready[-1].tokens, drafts=self._drafts(ready))
        if not plan.rows:
            return None
        for slot, adapter in plan.loads:
            self.executor.load_adapter(slot, adapter.weights)
        step, slots = self.planner.build(plan, self._num_steps, previous.slots if previous is not None else None,
                                         defer_masks=previous is not None, ready=ready)
        masks_pending = step.switches.constrain and step.sampling.allowed is None
        handle = self.executor.launch(step, sample=not masks_pending)
        launched = LaunchedStep(plan, slots, handle, masks_pending)
        now = time.time()
        for row in plan.rows:
            if row.seq.scheduled_time is None:
                row.seq.scheduled_time = now
            row.seq.num_computed += row.length
            if row.samples:
                row.seq.output_ids.append(PENDING_TOKEN)
                row.seq.tokens_in_flight += 1
        self._num_steps += 1
        self._last_batch = len(plan.rows)
        self._max_batch = max(self._max_batch, self._last_batch)
        return launched

    def _sample_constrained(self, launched: LaunchedStep) -> None:
        """Launch the sampling of a step whose forward pass is running, under the masks of its
        grammars (which have now seen every token before this step's)."""
        rows = list(zip(launched.slots.slots, launched.plan.rows))
        self.executor.sample(launched.handle, self.planner.allowed_tokens(rows, launched.slots.num_slots))

    def _finish(self, launched: LaunchedStep) -> list[TokenDelta]:
        """Wait for a launched step and turn its results into deltas."""
        results = _row_results(launched.plan, launched.slots, self.executor.fetch(launched.handle))
        over = self._feed_grammars(launched.plan.rows, results)
        deltas = [self._advance(row, result, over.get(row.seq.request_id, False))
                  for row, result in zip(launched.plan.rows, results)]
        return [delta for delta in deltas if delta is not None]

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
        tokens = self._keep(row, result.tokens)
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
            seq.sent_first = True
            delta.num_prompt_tokens = len(seq.prompt_ids)
            delta.num_cached_tokens = seq.num_cached_prompt
            delta.scheduled_time = seq.scheduled_time
            if seq.params.prompt_logprobs is not None:
                delta.prompt_logprobs = list(seq.prompt_logprobs)
        if delta.finished:
            del seq.output_ids[generated + len(tokens) - 1 :]  # tokens after the last one sent, never sent
            seq.tokens_in_flight = 0
            self._sequences.pop(seq.request_id, None)
            self._end(seq)
        return delta

    def _end(self, seq: Sequence) -> None:
        """A sequence is done (finished or aborted): its pages and image slots go back."""
        self.scheduler.finish(seq)
        for slot in seq.image_slots:
            self.images.release(slot)
        seq.image_slots = []

    def _check_images(self, prompt_ids: list[int], params: SamplingParams, images: tuple[ImageInput, ...]) -> None:
        if self.images is None:
            if images:
                raise InvalidRequestError("this model takes no images; send text only, or serve a vision-language "
                                          "model", "messages")
            return
        runs = _placeholder_runs(prompt_ids, self.image_token_id)
        n = self.images.tokens_per_image
        if len(runs) != len(images) or any(length != n for _, length in runs):
            raise InvalidRequestError(f"the prompt places {len(runs)} images ({[length for _, length in runs]} "
                                      f"placeholder tokens) but the request sends {len(images)}, each taking {n}",
                                      "messages")
        if len({image.content_hash for image in images}) > self.images.slots:
            raise InvalidRequestError(f"the request sends more distinct images than the {self.images.slots} this "
                                      "server holds at once; send fewer, or raise image_slots", "messages")
        if images and params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt logprobs are not computed for prompts with images; leave them out",
                                      "prompt_logprobs")

    def _queue(self, seq: Sequence) -> None:
        self._sequences[seq.request_id] = seq
        self.scheduler.add(seq)

    def _place_awaiting(self) -> None:
        """Queue the requests with images whose images all get slots now, first come first served:
        one waits while running requests hold the slots it needs, and those behind it wait too."""
        while self._awaiting_images:
            request_id, (seq, images) = next(iter(self._awaiting_images.items()))
            if not self.images.can_acquire({image.content_hash for image in images}):
                return
            del self._awaiting_images[request_id]
            seq.image_slots = self._place_images(seq.prompt_ids, images)
            self._queue(seq)

    def _place_images(self, prompt: list[int], images: tuple[ImageInput, ...]) -> list[int]:
        """Hold a slot for each image (the ones a slot has first; `can_acquire` said they fit),
        computing the features of an image no slot has, and replace each image's placeholders in
        `prompt` with its image tokens; the slots held, one per image."""
        slots = [-1] * len(images)
        for i in sorted(range(len(images)), key=lambda i: not self.images.holds(images[i].content_hash)):
            slots[i], fresh = self.images.acquire(images[i].content_hash)
            if fresh:
                self.executor.add_image(slots[i], images[i].pixels)
        for (start, length), slot in zip(_placeholder_runs(prompt, self.image_token_id), slots):
            prompt[start: start + length] = self.images.token_ids(slot)
        return slots

    def _keep(self, row: Row, sampled: list[int]) -> list[int]:
        """The tokens a row emits: its sampled token, or for a row with guesses the guesses the
        model agreed with and the token after them (engine.generate.speculation)."""
        if not row.drafts:
            return sampled[:1]
        tokens = kept_tokens(row.drafts, sampled)
        self._num_drafts += 1
        self._num_draft_tokens += len(row.drafts)
        self._num_accepted_tokens += len(tokens) - 1
        return tokens

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


def _placeholder_runs(prompt: list[int], token: Optional[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of `token` in `prompt`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(prompt):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
