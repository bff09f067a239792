"""A runner's jitted step programs over the model's flat weights: the forward program (its size:
the bucket's tokens; it donates the KV cache) and the sampling program (its size: the bucket's
sampling slots), plus the prompt-logprobs program. Used by the `ModelRunner` to run steps and by the AOT
tool (engine.tools.aot_compile) to compile them for a TPU topology without running them.

`ProgramWarmup` compiles them a bucket at a time, for engine.compiler's `StepCompiler`, without
running them: with the types of a real step's arguments, so the step finds them in jit's cache.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, ContextManager, Optional, Sequence

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from engine.backends.base import AttentionBackend
from engine.generate.grammar import mask_words
from engine.generate.planner import draft_inputs, empty_step_plan
from engine.generate.runner import sharding
from engine.generate.runner.draft import DraftSteps
from engine.generate.runner.sampler import SampleOutput, sample, token_logprobs
from engine.layers.lora import LoraPool
from engine.models.paged_model import ImageRows, ServingModel, forward, logits_at, unembed, with_previous_tokens
from engine.step.buckets import Bucket, ShapeBuckets
from engine.step.plan import FIRST_SAMPLER_SWITCHES, WARM_SAMPLER_SWITCHES, SamplerSwitches


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """One compiled step program: its name, the executable and the seconds lowering and compiling took."""

    name: str
    executable: Any
    seconds: float


class StepPrograms:
    """The jitted functions: the forward program (its size: the bucket's tokens) and the sampling
    program (its size: the bucket's sampling slots), which runs the LM head on the rows that
    sample, so a long prompt's step computes one row of logits. The model travels as its flat list
    of weight arrays (the treedef is closed over): jit flattens a list of arrays in C++, where
    equinox modules would be flattened in Python on every call. Hidden states and sampled tokens leave
    replicated; the cache keeps its split by KV head."""

    def __init__(self, model: ServingModel, backend: AttentionBackend, mesh: Mesh, cache_sharding, max_samples: int,
                 vocab_split: bool):
        self.weights, treedef = jax.tree_util.tree_flatten(model)
        unflatten = functools.partial(jax.tree_util.tree_unflatten, treedef)
        self.head_weights, head_treedef = jax.tree_util.tree_flatten(dataclasses.replace(model, layers=()))
        unflatten_head = functools.partial(jax.tree_util.tree_unflatten, head_treedef)
        replicated = sharding.replicated(mesh)
        constrain = jax.lax.with_sharding_constraint
        gathered = vocab_gather(mesh, vocab_split)

        @functools.partial(jax.jit, donate_argnums=(1,))
        def forward_step(weights, cache, inputs, prev_tokens, lora, images):
            """(hidden states f[max_samples, embed] of the tokens each sampling slot samples after,
            all final hidden states f[position, embed], updated cache)."""
            model = unflatten(weights)
            hidden, cache = forward(model, backend, cache, with_previous_tokens(inputs, prev_tokens), lora, images)
            # plain arrays leave: a NamedArray output is unflattened in Python per call
            rows = hidden.array[inputs.sample_index]
            return constrain(rows, replicated), constrain(hidden.array, replicated), constrain(cache, cache_sharding)

        @functools.partial(jax.jit, static_argnames=("switches",))
        def sample_step(head_weights, rows, sampling, switches: SamplerSwitches) -> SampleOutput:
            """The logits of the first R slots (R: the sampling inputs' rows), sampled. Tokens are
            padded to `max_samples`, so that the next step's forward takes them in one shape."""
            head = unflatten_head(head_weights)
            picked = hax.named(rows[: sampling.temperature.shape[0]], ("row", head.Embed))
            logits = gathered(unembed(head, picked).array)
            out = sample(logits, sampling, switches, backend.argmax)
            return out._replace(tokens=jnp.pad(out.tokens, (0, max_samples - out.tokens.shape[0])))

        @jax.jit
        def prompt_logprobs_step(weights, hidden, index, targets):
            model = unflatten(weights)
            hidden = hax.named(hidden, ("position", model.Embed))
            logits = gathered(logits_at(model, hidden, index).array)
            return token_logprobs(logits, targets)

        self._forward, self._sample, self._prompt_logprobs = forward_step, sample_step, prompt_logprobs_step

    def forward(self, cache, inputs, prev_tokens, lora: Optional[LoraPool] = None, images: Optional[ImageRows] = None):
        """(the sampling slots' hidden states f[max_samples, embed], final hidden states
        f[position, embed], updated cache); donates `cache`. `lora`: the adapters' pool, if any;
        `images`: the image features, if the model takes images."""
        return self._forward(self.weights, cache, inputs, prev_tokens, lora, images)

    def sample(self, rows, sampling, switches: SamplerSwitches) -> SampleOutput:
        return self._sample(self.head_weights, rows, sampling, switches=switches)

    def lower_sample(self, rows, sampling, switches: SamplerSwitches):
        """`sample` lowered for these arguments' types (`rows` may be a ShapeDtypeStruct)."""
        return self._sample.lower(self.head_weights, rows, sampling, switches=switches)

    def lower_forward(self, cache, inputs, prev_tokens, lora: Optional[LoraPool] = None,
                      images: Optional[ImageRows] = None):
        """`forward` lowered for these arguments' types (`cache` may be ShapeDtypeStructs)."""
        return self._forward.lower(self.weights, cache, inputs, prev_tokens, lora, images)

    def prompt_logprobs(self, hidden, index, targets):
        return self._prompt_logprobs(self.weights, hidden, index, targets)

    def compile_bucket(self, bucket: Bucket, buckets: ShapeBuckets, cache, prev_tokens, vocab_size: int,
                       place, samplers: Sequence[SamplerSwitches] = WARM_SAMPLER_SWITCHES,
                       lora: Optional[LoraPool] = None, images: Optional[ImageRows] = None) -> list[CompiledProgram]:
        """Lower and compile (never run) one bucket's forward program and the `samplers` variants
        for its rows, with a padding step's arguments: `place` turns its host arrays into the step's
        arguments (or their types); `cache`, `prev_tokens` and `lora` may be types. Call under the
        mesh. A forward program compiled before comes from jit's in-memory cache."""
        plan = empty_step_plan(bucket, buckets, step_id=-1)
        every_token = np.full((bucket.samples, mask_words(vocab_size)), -1, np.int32)
        inputs, sampling, masked = place((plan.inputs, plan.sampling, plan.sampling._replace(allowed=every_token)))
        start = time.perf_counter()
        lowered = self.lower_forward(cache, inputs, prev_tokens, lora, images)
        forward = lowered.compile()
        programs = [CompiledProgram(f"forward T={bucket.tokens}", forward, time.perf_counter() - start)]
        if samplers:
            info = lowered.out_info[0]  # the sampled rows' hidden states, as the forward program hands them over
            rows = jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=forward.output_shardings[0])
            for switches in samplers:
                start = time.perf_counter()
                compiled = self.lower_sample(rows, masked if switches.constrain else sampling, switches).compile()
                programs.append(CompiledProgram(f"sample R={bucket.samples} {switches.name}", compiled,
                                                time.perf_counter() - start))
        return programs


def vocab_gather(mesh: Mesh, vocab_split: bool):
    """f(logits) -> logits computed where their slice of the vocabulary lives, then gathered: left
    to itself, XLA gathers a tied embedding's whole weight onto every device every step."""
    replicated = sharding.replicated(mesh)
    by_vocab = NamedSharding(mesh, PartitionSpec(None, sharding.MODEL_AXIS)) if vocab_split else replicated
    constrain = jax.lax.with_sharding_constraint
    return lambda logits: constrain(constrain(logits, by_vocab), replicated)


@dataclasses.dataclass(frozen=True)
class StepTypes:
    """The types (shape, dtype, sharding) of a step's device arguments, to compile against while
    steps donate and replace the arrays themselves."""

    cache: Any
    prev_tokens: jax.Array
    """A real array of no tokens: its type carries the mesh, as a sampled-token array's does."""
    lora: Any = None
    images: Any = None
    draft_cache: Any = None


class ProgramWarmup:
    """Compiles one bucket's programs at a time (`compile_bucket`, in the replica's compile order):
    the forward program and the common sampler variants for its rows, and with a draft model its
    forward program and, up to a full batch of decodes, its propose program of as many rows. The
    first bucket, which serving waits for, takes only FIRST_SAMPLER_SWITCHES when more follow; the
    next call compiles its other variants first."""

    def __init__(self, steps: StepPrograms, draft_steps: Optional[DraftSteps], buckets: ShapeBuckets,
                 vocab_size: int, types: StepTypes, place: Callable, on_devices: Callable[[], ContextManager]):
        """`place` turns host arrays into a step's arguments; `on_devices` enters the runner's mesh."""
        self.steps, self.draft_steps, self.buckets, self.vocab_size = steps, draft_steps, buckets, vocab_size
        self.types, self.place, self.on_devices = types, place, on_devices
        self._more_follow = len(buckets.compile_order()) > 1
        self._sampler_sizes: set[int] = set()
        self._owed: Optional[Bucket] = None
        """The first bucket, while its other sampler variants wait for the next compile."""

    def compile_bucket(self, bucket: Bucket) -> None:
        first = not self._sampler_sizes
        with self.on_devices():
            if self._owed is not None:
                owed, self._owed = self._owed, None
                self._compile(owed, [s for s in WARM_SAMPLER_SWITCHES if s not in FIRST_SAMPLER_SWITCHES])
            if first and self._more_follow:
                self._compile(bucket, FIRST_SAMPLER_SWITCHES)
                self._owed = bucket
            else:
                self._compile(bucket, () if bucket.samples in self._sampler_sizes else WARM_SAMPLER_SWITCHES)
            if self.draft_steps is not None:
                self._compile_draft(bucket)
        self._sampler_sizes.add(bucket.samples)

    def _compile(self, bucket: Bucket, samplers: Sequence[SamplerSwitches]) -> None:
        t = self.types
        self.steps.compile_bucket(bucket, self.buckets, t.cache, t.prev_tokens, self.vocab_size, self.place,
                                  samplers=samplers, lora=t.lora, images=t.images)

    def _compile_draft(self, bucket: Bucket) -> None:
        inputs = self.place(empty_step_plan(bucket, self.buckets, step_id=-1).inputs)
        self.draft_steps.lower_forward(self.types.draft_cache, inputs, self.types.prev_tokens).compile()
        if bucket.tokens <= self.buckets.decode_bucket().tokens:  # a propose program of as many rows
            draft = self.place(draft_inputs(self.buckets, [], ready=[bucket]))
            self.draft_steps.lower_propose(self.types.draft_cache, draft).compile()
