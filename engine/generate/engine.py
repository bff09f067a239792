"""The engine: add requests, abort them, and step.

One request's path: `add_request` validates it and queues a `Sequence`; each `step()` asks the
scheduler for a plan (which sequences run, how many tokens each), turns it into a step plan (plain
arrays, engine.generate.planner), has the executor launch it, and returns one `TokenDelta` per
sequence that produced a token (engine.generate.postprocess; plus one per aborted request). A
finished or aborted sequence returns all its pages at once. Beside the scheduler, managers own
the rest, each pure Python: the `Speculator` (guesses), the `ImageAdmission` (image slots), the
`AdapterRegistry` (LoRA adapters) and the `Postprocessor` (a fetched step's tokens and deltas).

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

Speculative decoding (`speculative`, engine.generate.speculation's `Speculator`): decoding rows
carry guessed tokens (prompt lookup's, on the host, or a draft model's, from the executor), and
the step samples after each; the engine keeps the guesses the model agrees with. A step with
guesses is finished before the next is planned (its rows' lengths depend on what was kept), and
guesses are made only from tokens the host has: while a step is in flight, the engine waits for
it first only when guesses are likely (prompt lookup: a sequence's known tokens already repeat; a
draft model: always while a row has room for one); otherwise steps keep overlapping.

LoRA adapters (`max_loras`, engine.generate.adapters' `AdapterRegistry`): `add_adapter` reads an
adapter into host memory under a name (any thread); a request that names it runs with it. The
scheduler admits it once its adapter has one of the devices' slots, and the step that first reads
a newly given slot loads the adapter into it first.

Images (a vision-language model, engine.generate.images' `ImageAdmission`): a request's images
take device slots, their features computed into slots no other image has, before it is queued
for the scheduler; while running requests hold the slots its images need, it waits (first come,
first served) and is placed at the step after they end.

Single-threaded by design: `AsyncEngine` drives it from one background thread.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any, Optional

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.formats.peft import read_adapter
from engine.generate.adapters import AdapterRegistry
from engine.generate.executor.base import make_executor
from engine.generate.grammar import GrammarCompiler
from engine.generate.images import ImageAdmission, ImageInput
from engine.generate.pages import PageAllocator
from engine.generate.planner import RowSlots, StepPlanner
from engine.generate.postprocess import Postprocessor
from engine.generate.request import FinishReason, SamplingParams, TokenDelta, check_request
from engine.generate.scheduler import PENDING_TOKEN, Plan, Scheduler, SchedulerConfig, Sequence
from engine.generate.speculation import NgramProposer, Speculator
from engine.stats import EngineStats


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


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.executor = make_executor(config)
        self.max_model_len = self.executor.facts.max_model_len
        self.allocator = PageAllocator(self.executor.facts.num_pages, config.page_size, config.enable_prefix_caching)
        self._adapters = AdapterRegistry(config.max_loras, self._read_adapter)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                prefill_chunk=config.prefill_chunk or config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                long_rope_from=self.executor.facts.info.long_rope_from,
            ),
            self.allocator,
            self._adapters.slots,
        )
        self.eos_token_ids = frozenset(self.executor.facts.info.eos_token_ids)
        self.vocab_size = self.executor.facts.vocab_size
        self.grammars = GrammarCompiler(config.model, self.vocab_size, tuple(sorted(self.eos_token_ids)))
        self.planner = StepPlanner(self.executor.facts.buckets, self.vocab_size, self.executor.facts.info.eos_token_ids,
                                   self.grammars)
        self.image_admission = ImageAdmission(self.executor.facts.image_layout, self.vocab_size,
                                              self.executor.add_image)
        self.image_token_id: Optional[int] = self.image_admission.image_token_id
        """The prompt's image placeholder token (a model that takes images), else None."""
        self.images = self.image_admission.slots
        """Which image each device slot holds (engine.generate.images), or None: a text-only model."""
        if self.images is not None and config.draft_model:
            raise ValueError("a draft model cannot guess after image tokens; use speculative method ngram or none "
                             "with a vision-language model")
        self.speculator = Speculator(config.speculative, self.scheduler, self.executor.facts.flat_step_tokens,
                                     self.executor.facts.buckets, self.executor.propose)
        self.postprocessor = Postprocessor(self.grammars, self.speculator, self.eos_token_ids, self.max_model_len)
        self._sequences: dict[str, Sequence] = {}
        self._aborted: list[str] = []
        self._in_flight: Optional[LaunchedStep] = None
        self._seeds = random.Random(config.seed)
        self._num_steps = 0
        self._last_batch = 0
        self._max_batch = 0
        self.warmup_seconds: Optional[float] = self.executor.warmup() if config.warmup else None
        """Seconds until the first step program was ready (the rest compile in the background)."""

    @property
    def proposer(self) -> Optional[NgramProposer]:
        """Prompt-lookup guesses for decoding rows (speculative decoding by n-gram), or None."""
        return self.speculator.proposer

    @property
    def max_step_tokens(self) -> int:
        """Token slots a step's decoding rows and their guesses take at most."""
        return self.speculator.max_step_tokens

    # ---- the surface ----

    def validate(self, prompt_ids: list[int], params: SamplingParams, adapter: Optional[str] = None,
                 images: tuple[ImageInput, ...] = ()) -> None:
        """Raise InvalidRequestError if this request can never be served (an invalid grammar, an
        unknown adapter, images the prompt does not place or a text-only model cannot see
        included). Thread-safe."""
        check_request(prompt_ids, params, self.vocab_size, self.max_model_len)
        self.image_admission.check(prompt_ids, params, images)
        self._adapters.check(adapter)
        if params.grammar is not None:  # compiled once: `add_request` finds it compiled
            self.grammars.compile(params.grammar)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    adapter: Optional[str] = None, images: tuple[ImageInput, ...] = ()) -> None:
        """Queue a request; `adapter`: the name of a LoRA adapter to run it with (None: the base
        model); `images`: one per run of tokens_per_image image placeholders in the prompt, in order."""
        self.validate(prompt_ids, params, adapter, images)
        if request_id in self._sequences or request_id in self.image_admission:
            raise InvalidRequestError(f"request id {request_id!r} is already running", "request_id")
        seq = self._new_sequence(request_id, prompt_ids, params, adapter)
        if images:
            self.image_admission.submit(seq, images)
            self._admit_images()
        else:
            self._queue(seq)

    def abort(self, request_id: str) -> None:
        """Free the request's pages now; its stream ends with an `abort` delta at the next step."""
        seq = self._sequences.pop(request_id, None)
        if seq is not None:
            self._end(seq)
        if seq is not None or self.image_admission.withdraw(request_id):
            self._aborted.append(request_id)

    def add_adapter(self, name: str, path: str) -> None:
        """Read the PEFT LoRA adapter at `path` and serve it as `name` (replacing an adapter of that
        name; requests already running keep the one they started with). ValueError if the
        engine cannot serve it (the message says why). Any thread."""
        self._adapters.add(name, path)

    def remove_adapter(self, name: str) -> bool:
        """Stop serving adapter `name` (requests running with it finish with it); False if unknown."""
        return self._adapters.remove(name)

    def adapters(self) -> list[str]:
        return self._adapters.names()

    def has_work(self) -> bool:
        return (bool(self._aborted) or self._in_flight is not None or self.scheduler.has_work()
                or self.image_admission.num_waiting > 0)

    def step(self) -> list[TokenDelta]:
        deltas = [TokenDelta(rid, [], finish_reason=FinishReason.ABORT) for rid in self._aborted]
        self._aborted.clear()
        self._admit_images()
        previous, self._in_flight = self._in_flight, None
        if previous is not None and (self._needs_host_tokens() or self.speculator.guesses_likely()):
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
        return {**self.executor.facts.description, "max_model_len": str(self.max_model_len)}

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
            num_waiting=len(self.scheduler.waiting) + self.image_admission.num_waiting,
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
            lora_slots_in_use=self._adapters.slots_in_use(),
            spec_drafts=self.speculator.num_drafts,
            spec_draft_tokens=self.speculator.num_draft_tokens,
            spec_accepted_tokens=self.speculator.num_accepted_tokens,
        )

    # ---- internals ----

    def _needs_host_tokens(self) -> bool:
        """Whether planning the next step needs every token sampled so far on the host."""
        return any(seq.params.needs_penalties for seq in self.scheduler.running)

    def _launch(self, previous: Optional[LaunchedStep]) -> Optional[LaunchedStep]:
        """Plan and dispatch the next step (None if nothing can run); advance its rows."""
        if not self.scheduler.has_work():
            return None
        ready = self.executor.ready_buckets()  # while programs compile, steps fit the ready ones
        plan = self.scheduler.schedule(max_tokens=ready[-1].tokens, drafts=self.speculator.drafts(ready))
        if not plan.rows:
            return None
        for slot, adapter in plan.loads:
            self.executor.load_adapter(slot, adapter.weights)
        step, slots = self.planner.build(plan, self._num_steps, previous.slots if previous is not None else None,
                                         defer_masks=previous is not None, ready=ready)
        masks_pending = step.switches.constrain and step.sampling.allowed is None
        launched = LaunchedStep(plan, slots, self.executor.launch(step, sample=not masks_pending), masks_pending)
        _advance_rows(plan, time.time())
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
        """Wait for a launched step, turn its results into deltas, and end the sequences they finish."""
        deltas, ended = self.postprocessor.process(launched.plan, launched.slots, self.executor.fetch(launched.handle))
        for seq in ended:
            self._sequences.pop(seq.request_id, None)
            self._end(seq)
        return deltas

    def _end(self, seq: Sequence) -> None:
        """A sequence is done (finished or aborted): its pages and image slots go back."""
        self.scheduler.finish(seq)
        self.image_admission.release(seq)

    def _new_sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      adapter: Optional[str]) -> Sequence:
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        seq = Sequence(request_id, list(prompt_ids), params, seed)
        seq.adapter = self._adapters.get(adapter)
        seq.prompt_logprobs = [None] * len(prompt_ids)
        if params.grammar is not None:
            seq.grammar = self.grammars.state(params.grammar)
        return seq

    def _queue(self, seq: Sequence) -> None:
        self._sequences[seq.request_id] = seq
        self.scheduler.add(seq)

    def _admit_images(self) -> None:
        """Queue the requests whose images got slots (engine.generate.images.ImageAdmission)."""
        for seq in self.image_admission.admit():
            self._queue(seq)

    def _read_adapter(self, path: str):
        """An adapter's host-side factors, for this model and the executor's LoRA slots."""
        return read_adapter(path, self.executor.facts.info, self.config.max_lora_rank, self.executor.facts.lora_targets)


def _advance_rows(plan: Plan, now: float) -> None:
    """A launched step's rows are computed, and each sampling row's token is in flight (a
    `PENDING_TOKEN` until the step is fetched: engine.generate.postprocess)."""
    for row in plan.rows:
        if row.seq.scheduled_time is None:
            row.seq.scheduled_time = now
        row.seq.num_computed += row.length
        if row.samples:
            row.seq.output_ids.append(PENDING_TOKEN)
            row.seq.tokens_in_flight += 1
