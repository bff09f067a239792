"""The device side of one engine: weights, the KV cache and the jitted step. The only module that
dispatches to devices and reads results back.

    StepPlan -> forward (donates the cache) -> sample -> StepOutput

`launch(plan)` dispatches a step and returns at once (XLA runs it asynchronously); `fetch` waits
for its sampled tokens. A step launched while the previous one still runs reads the tokens that
step is sampling straight from its device output (`StepInputs.prev_slot`), so the host never waits
between steps; a plan names the step it reads, and a runner that did not launch that step last
refuses it.

Devices: `tensor_parallel_size` devices form the mesh (engine.generate.runner.sharding); weights and the KV
cache are split over it, and the step's outputs (logits, sampled tokens, logprobs) come back
replicated. The attention backend (engine.backends) owns the cache and attention; the runner
never asks which one runs.

Warm-up compiles the first step program, then the others in the background (engine.compiler),
each with the common sampler variants; `ready_buckets` says which a step may take. The rarer
variants (penalties, top-k/p filtering) and prompt logprobs compile on first use.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from engine.backends.base import AttentionBackend, CacheShape
from engine.backends.select import select_backend
from engine.compiler import StepCompiler, enable_compilation_cache
from engine.config import EngineConfig
from engine.formats.peft import LoraAdapter
from engine.generate.buckets import SMALLEST_BATCH, Bucket, ShapeBuckets
from engine.generate.grammar import mask_words
from engine.generate.runner import sharding
from engine.generate.runner.draft import DraftShape, DraftSteps
from engine.generate.runner.sampler import SampleOutput, sample, token_logprobs
from engine.generate.step_plan import (
    FIRST_SAMPLER_SWITCHES,
    WARM_SAMPLER_SWITCHES,
    DraftInputs,
    SamplerSwitches,
    StepOutput,
    StepPlan,
    draft_inputs,
    empty_step_plan,
)
from engine.layers.lora import LoraPool, LoraShape, load_slot, slot_arrays
from engine.layers.quantize import quantize_model
from engine.layers.rope import Rope
from engine.models.loading import load_model, model_info, read_hf_config, resolve_dtype
from engine.models.paged_model import (
    ImageRows,
    ServingModel,
    forward,
    logits_at,
    unembed,
    with_previous_tokens,
)
from engine.models.variant import Variant
from engine.tools import capacity

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StepHandle:
    """A step dispatched to the devices; `ModelRunner.fetch` waits for and reads its results."""

    step_id: int
    out: Optional[SampleOutput]
    """On device until fetched; `out.tokens` feeds the next step's pending tokens. None until
    `ModelRunner.sample` dispatches a deferred sampling."""
    logprobs: bool
    prompt: Optional[tuple]
    """Device arrays of the prompt logprobs the step computes, if any."""
    unsampled: Optional[tuple] = None
    """(sampled rows' hidden states, sampling inputs, switches) of a step launched with its
    sampling deferred."""


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """One compiled step program: its name, the executable and the seconds lowering and compiling took."""

    name: str
    executable: Any
    seconds: float


class _Steps:
    """The jitted functions: the forward program (its size: the bucket's tokens) and the sampling
    program (its size: the bucket's rows), which runs the LM head on the rows that sample, so a
    long prompt's step computes one row of logits. The model travels as its flat list of weight
    arrays (the treedef is closed over): flattening equinox modules in Python on every call costs
    ~1 ms a step, a list of arrays is flattened in C++. Hidden states and sampled tokens leave
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
        every_token = np.full((bucket.rows, mask_words(vocab_size)), -1, np.int32)
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
                programs.append(CompiledProgram(f"sample R={bucket.rows} {switches.name}", compiled,
                                                time.perf_counter() - start))
        return programs


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.compilation_cache_dir:
            enable_compilation_cache(config.compilation_cache_dir)
        info = model_info(config.model)
        self.dtype = resolve_dtype(config.dtype, info)
        self.kv_cache_dtype = config.kv_cache_dtype or self.dtype
        self.layout = sharding.plan_layout(info, config.tensor_parallel_size)
        self.mesh = sharding.make_mesh(config.tensor_parallel_size)
        self.backend = select_backend(config, self.dtype, self.mesh, sharding.MODEL_AXIS)
        self.scan_layers = self.backend.scan_layers if config.scan_layers is None else config.scan_layers
        self.max_model_len = capacity.max_model_len(config, info)
        if self.max_model_len > info.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                             f"{info.max_position_embeddings}; lower max_model_len")
        self.page_size = config.page_size
        self.max_pages_per_seq = -(-self.max_model_len // self.page_size)
        self.buckets = ShapeBuckets(max_num_seqs=config.max_num_seqs,
                                    max_num_batched_tokens=config.max_num_batched_tokens,
                                    max_pages_per_seq=self.max_pages_per_seq, page_size=self.page_size,
                                    max_drafts=config.max_drafts)
        memory = sharding.free_device_memory(self.mesh.devices.flat)
        if memory is not None:  # accelerators: refuse a config that cannot fit before loading a weight
            capacity.check_fits(config, memory, len(jax.devices()), self.backend.cache_bytes_per_page)
        self.model, self.info = self._load(config)
        self.vocab_size = self.info.vocab_size
        self.draft_model, self.draft_info, self.draft_layout = self._load_draft(config)
        """The draft model of speculative decoding (engine.generate.runner.draft), or None."""
        self.lora = self._lora_pool()
        """The LoRA adapters' pool on the devices (engine.layers.lora), or None without `max_loras`."""
        self._lora_type = _types(self.lora)
        self.vision_config, self.images, self._write_image = self._load_vision(config)
        """The vision tower's config (engine.models.vision), the pool of image features
        (paged_model.ImageRows) and the program computing one image's features into it (it holds
        the tower and projector); all None for a text-only model."""
        self._images_type = _types(self.images)
        self._cache_sharding = NamedSharding(self.mesh, self.backend.cache_partition(sharding.MODEL_AXIS))
        self.num_pages = self._pool_pages()
        self.cache = self._init_cache()
        self._cache_type = _types(self.cache)
        """The cache's types, for compiling while steps donate and replace the cache itself."""
        self.draft_cache = None if self.draft_model is None else self._init_cache(self.draft_info, self.draft_layout)
        self._draft_cache_type = _types(self.draft_cache)
        self.draft_steps = None if self.draft_model is None else DraftSteps(
            self.draft_model, self.backend, DraftShape(config.max_drafts, self.page_size),
            vocab_gather(self.mesh, self.draft_layout.size > 1 and self.draft_layout.shard_vocab),
            self._cache_sharding)
        self.steps = _Steps(self.model, self.backend, self.mesh, self._cache_sharding, self.buckets.max_samples,
                            vocab_split=self.layout.size > 1 and self.layout.shard_vocab)
        self._no_tokens = self._no_previous_tokens()
        self._last_step: Optional[int] = None
        self._last_tokens = self._no_tokens
        self._sampler_rows: set[int] = set()
        self._owed: Optional[Bucket] = None
        """The first bucket, while its other sampler variants wait for the next compile."""
        self.compiler = StepCompiler(self.buckets.compile_order(), self._compile_bucket,
                                     lambda b: f"({b.tokens} tokens, {b.rows} rows)")
        logger.info("%s", self._startup_line())

    # ---- public ----

    def launch(self, plan: StepPlan, sample: bool = True) -> StepHandle:
        """Dispatch one step without waiting for it. With `sample=False` only the forward pass
        goes: `sample` must dispatch the sampling before the next step is launched."""
        if plan.reads_step is not None and (plan.reads_step != self._last_step or self._last_tokens is None):
            raise RuntimeError(f"step {plan.step_id} reads the tokens of step {plan.reads_step}, but the last step "
                               f"sampled here was {self._last_step if self._last_tokens is not None else None} "
                               "(engine bug)")
        prev_tokens = self._last_tokens if plan.reads_step is not None else self._no_tokens
        inputs, sampling, prompt_inputs = self._global((plan.inputs, plan.sampling, plan.prompt_logprobs))
        with self._device_context():
            rows, hidden, self.cache = self.steps.forward(self.cache, inputs, prev_tokens, self.lora, self.images)
            if self.draft_steps is not None:  # the draft's cache takes every token the served model's does
                self.draft_cache = self.draft_steps.forward(self.draft_cache, inputs, prev_tokens)
            out = self.steps.sample(rows, sampling, plan.switches) if sample else None
            prompt = None
            if prompt_inputs is not None:
                prompt = self.steps.prompt_logprobs(hidden, *prompt_inputs)
        self._last_step, self._last_tokens = plan.step_id, out.tokens if sample else None
        unsampled = None if sample else (rows, sampling, plan.switches)
        return StepHandle(plan.step_id, out, plan.switches.logprobs, prompt, unsampled)

    def sample(self, handle: StepHandle, allowed) -> None:
        """Dispatch the deferred sampling of the step last launched, under the token bitmask
        `allowed` (i32[R, ceil(V / 32)])."""
        if handle.unsampled is None or handle.step_id != self._last_step:
            raise RuntimeError(f"step {handle.step_id} has no deferred sampling to run (engine bug)")
        rows, sampling, switches = handle.unsampled
        with self._device_context():
            handle.out = self.steps.sample(rows, sampling._replace(allowed=self._global(allowed)), switches)
        handle.unsampled = None
        self._last_tokens = handle.out.tokens

    def propose(self, draft: DraftInputs) -> np.ndarray:
        """The draft model's guesses i32[S, num_tokens] after each row's last token (after the
        steps launched so far; waits for them)."""
        if self.draft_steps is None:
            raise RuntimeError("this runner has no draft model (engine bug)")
        with self._device_context():
            guesses, self.draft_cache = self.draft_steps.propose(self.draft_cache, self._global(draft))
        return _to_host(guesses)

    def add_image(self, slot: int, pixels: np.ndarray) -> None:
        """Compute an image's features (pixels f[3, H, W], preprocessed) into slot `slot` of the pool
        (after the steps launched so far, which read the slot's previous image)."""
        if self.images is None:
            raise RuntimeError("this runner's model takes no images (engine bug)")
        index, pixels = self._global((np.asarray(slot, np.int32), np.asarray(pixels, np.float32)[None]))
        with self._device_context():
            self.images = self._write_image(self.images, index, pixels)

    @property
    def image_layout(self) -> Optional[tuple[int, int, int]]:
        """(image token id of the prompt's placeholders, tokens per image, slots), or None: no images."""
        if self.images is None:
            return None
        return self.vision_config.image_token_id, self.images.tokens_per_image, self.images.slots

    @property
    def flat_step_tokens(self) -> int:
        """Tokens a step holds at about the cost of one: on CPUs the smallest multi-token bucket
        (a matmul's cost grows with its rows past a handful), elsewhere the whole step budget (a
        step reads every weight once, whatever its rows, until far more tokens than a decode batch)."""
        if self.mesh.devices.flat[0].platform == "cpu":
            return min(SMALLEST_BATCH, self.config.max_num_batched_tokens)
        return self.config.max_num_batched_tokens

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """The projections adapters may adapt (empty without a LoRA pool)."""
        return () if self.lora is None else tuple(self.lora.a)

    def load_adapter(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter`'s factors into LoRA slot `slot` (after the steps launched so far, which
        read the slot's previous adapter)."""
        arrays = slot_arrays(adapter, self._lora_shape, self.info.num_kv_heads)
        index, arrays = self._global((np.asarray(slot, np.int32), arrays))
        with self._device_context():
            self.lora = self._load_slot(self.lora, index, arrays)

    def fetch(self, handle: StepHandle) -> StepOutput:
        """Wait for a launched step and read its results."""
        # each array fetched costs host time: the logprob arrays only when a row asked for them
        if handle.logprobs:
            tokens, logprobs, top_ids, top_logprobs = _to_host(tuple(handle.out))
        else:
            tokens, logprobs, top_ids, top_logprobs = _to_host(handle.out.tokens), None, None, None
        prompt = None if handle.prompt is None else _to_host(handle.prompt)
        return StepOutput(tokens, logprobs, top_ids, top_logprobs, prompt)

    def warmup(self, background: bool = True) -> float:
        """Compile the first step program now and the rest in the background (all now with
        `background=False`); returns the seconds until the first was ready (engine.compiler)."""
        seconds = self.compiler.start(background)
        if jax.process_count() > 1:  # every host starts serving together
            from jax.experimental.multihost_utils import sync_global_devices

            sync_global_devices("jax-serve warm-up")
        return seconds

    def ready_buckets(self) -> list[Bucket]:
        """The buckets a step may take now (StepCompiler.ready)."""
        return self.compiler.ready()

    def _compile_bucket(self, bucket: Bucket) -> None:
        """Compile one bucket's forward program and its common sampler variants without running
        them, with the arguments' types of a real step (so the step finds them in jit's cache).
        The first bucket, which serving waits for, takes only FIRST_SAMPLER_SWITCHES when more
        follow; the next call compiles its other variants first."""
        first = not self._sampler_rows
        with self._device_context():
            if self._owed is not None:
                owed, self._owed = self._owed, None
                self._compile_programs(owed, [s for s in WARM_SAMPLER_SWITCHES if s not in FIRST_SAMPLER_SWITCHES])
            if first and len(self.compiler.order) > 1:
                self._compile_programs(bucket, FIRST_SAMPLER_SWITCHES)
                self._owed = bucket
            else:
                self._compile_programs(bucket, () if bucket.rows in self._sampler_rows else WARM_SAMPLER_SWITCHES)
            if self.draft_steps is not None:
                inputs = self._global(empty_step_plan(bucket, self.buckets, step_id=-1).inputs)
                self.draft_steps.lower_forward(self._draft_cache_type, inputs, self._no_tokens).compile()
                if bucket.tokens <= self.buckets.decode_bucket().tokens:  # a propose program of as many rows
                    draft = self._global(draft_inputs(self.buckets, [], ready=[bucket]))
                    self.draft_steps.lower_propose(self._draft_cache_type, draft).compile()
        self._sampler_rows.add(bucket.rows)

    def _compile_programs(self, bucket: Bucket, samplers: Sequence[SamplerSwitches]) -> None:
        self.steps.compile_bucket(bucket, self.buckets, self._cache_type, self._no_tokens, self.vocab_size,
                                  self._global, samplers=samplers, lora=self._lora_type, images=self._images_type)

    def describe(self) -> dict[str, str]:
        """How this replica runs its model (logged at start; an info metric's labels)."""
        devices = list(self.mesh.devices.flat)
        return {
            "num_hosts": str(jax.process_count()),
            "attention_backend": self.backend.name,
            "dtype": self.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "quantization": self.config.quantization or "none",
            "tensor_parallel_size": str(self.layout.size),
            "num_devices": str(len(devices)),
            "device_kind": devices[0].device_kind,
            "mesh": ",".join(f"{name}={size}" for name, size in self.mesh.shape.items()),
            "page_size": str(self.page_size),
            "num_pages": str(self.num_pages),
            "speculative": "none" if self.config.speculative is None else self.config.speculative.method,
            "num_speculative_tokens": str(self.config.max_drafts),
            "draft_model": self.config.draft_model or "none",
        }

    def _global(self, tree):
        """Host arrays as the step's replicated inputs. In one process jit takes numpy as it is; over
        several, each process builds the global array from its own copy (a `device_put` onto a global
        sharding would compare the processes' values every step)."""
        if jax.process_count() == 1:
            return tree
        replicated = sharding.replicated(self.mesh)
        return jax.tree_util.tree_map(lambda a: jax.make_array_from_process_local_data(replicated, a), tree)

    # ---- start-up ----

    def _load(self, config: EngineConfig):
        """(the serving model, ModelInfo). Nothing of the model as loaded outlives this call: the
        KV pool is sized from the memory the serving model leaves. The serving model is made on the
        devices, each layer placed as it is made, or (`_weights_host`) on the host's CPU and then
        placed: the devices never hold the checkpoint's float weights beside quantized ones."""
        host = self._weights_host(config)
        if host is None:
            context = self._device_context(self._load_mapping(self.layout))
            place = functools.partial(sharding.place, layout=self.layout, mesh=self.mesh)
        else:
            context = _MeshContext(Mesh(np.array([host]).reshape(1, 1), self.mesh.axis_names), {})
            place = functools.partial(sharding.to_mesh, layout=self.layout, mesh=self.mesh)
        with context, jax.default_device(host):  # None: JAX's default device
            model, info = load_model(config.model, self.dtype)
            serving = serving_model(model, config.model, info, self.layout, self.scan_layers, place,
                                    config.quantization)
        self._lora_shape = LoraShape.of(serving.first_layer, info.num_layers, config.max_loras,
                                        config.max_lora_rank) if config.max_loras else None
        if host is not None:
            logger.info("weights made %s on %s, then placed on the devices", config.quantization, host)
        with self._device_context():
            return self.backend.prepare(serving, self.buckets, measure=config.warmup), info

    def _load_vision(self, config: EngineConfig):
        """(VisionConfig, empty ImageRows, write program) of a LLaVA checkpoint's text entry (its
        `vision` link, engine.formats.llava); (None, None, None) for any other model."""
        from engine.formats.llava import VISION_LINK

        source = Path(config.model) / VISION_LINK
        if not source.is_dir():
            return None, None, None
        import equinox as eqx

        from engine.models.vision import (
            image_features,
            image_tokens,
            load_vision,
            read_vision_config,
        )

        vision_config = read_vision_config(source)
        tokens = image_tokens(vision_config)
        replicated = sharding.replicated(self.mesh)
        with self._device_context():
            tower = jax.device_put(load_vision(source, self.dtype), replicated)
            rows = jax.device_put(jnp.zeros((config.image_slots * tokens, self.info.hidden_size), self.dtype),
                                  replicated)
        params, static = eqx.partition(tower, eqx.is_array)

        @functools.partial(jax.jit, donate_argnums=(0,))
        def write(images: ImageRows, slot, pixels) -> ImageRows:
            features = image_features(eqx.combine(params, static), pixels)[0].astype(images.rows.dtype)
            return dataclasses.replace(images, rows=jax.lax.dynamic_update_slice(
                images.rows, features, (slot * images.tokens_per_image, 0)))

        logger.info("vision tower %s: %d tokens per image, %d image slots", vision_config.tower, tokens,
                    config.image_slots)
        return vision_config, ImageRows(rows, self.vocab_size, tokens, config.image_slots), write

    def _load_draft(self, config: EngineConfig):
        """(the draft model, its ModelInfo, its layout) for `speculative: {method: draft_model}`,
        made on the devices and prepared by the backend as the served model is; else Nones."""
        if config.draft_model is None:
            return None, None, None
        from engine.formats.model_sources import resolve_model

        path = str(resolve_model(config.draft_model))
        info = model_info(path)
        if info.vocab_size != self.info.vocab_size:
            raise ValueError(f"the draft model {config.draft_model} has a vocabulary of {info.vocab_size} "
                             f"tokens, the served model {self.info.vocab_size}: a draft must share its tokenizer")
        layout = sharding.plan_layout(info, config.tensor_parallel_size)
        place = functools.partial(sharding.place, layout=layout, mesh=self.mesh)
        with self._device_context(self._load_mapping(layout)):
            model, info = load_model(path, self.dtype)
            serving = serving_model(model, path, info, layout, self.scan_layers, place, config.quantization)
        with self._device_context(layout.axis_mapping):
            draft = self.backend.prepare(serving, self.buckets, measure=config.warmup)
        logger.info("draft model %s: %d layers, %d guesses per row", path, info.num_layers, config.max_drafts)
        return draft, info, layout

    def _weights_host(self, config: EngineConfig) -> Optional[jax.Device]:
        """The host CPU device that quantized weights are made on before they go to the devices
        (so loading never holds the checkpoint's float weights on them); None: the weights are made
        on the devices themselves (no quantization, or the devices are the host's)."""
        host = sharding.host_device() if config.quantization else None
        return None if host is None or host in self.mesh.devices.flat else host

    @staticmethod
    def _load_mapping(layout: sharding.TensorParallelLayout) -> dict[str, str]:
        """The axis mapping to load weights under: the layout's, but KV heads that are to be
        repeated load whole (they split only after repeating)."""
        mapping = dict(layout.axis_mapping)
        if layout.kv_repeats > 1:
            mapping.pop("kv_head", None)
        return mapping

    def _cache_shape(self, num_pages: int, info=None, layout=None) -> CacheShape:
        """The KV cache of `num_pages` pages of the served model (or of `info` split as `layout`)."""
        return capacity.cache_shape(info or self.info, layout or self.layout, self.page_size, num_pages,
                                    self.kv_cache_dtype)

    def _pool_pages(self) -> int:
        """KV pages: as configured; else from the memory the weights left (accelerators) or enough
        for every sequence slot at max_model_len (CPUs, where memory is not reported)."""
        if self.config.num_pages:
            return self.config.num_pages
        free = sharding.free_device_memory(self.mesh.devices.flat)
        if free is None:
            return 1 + self.config.max_num_seqs * self.max_pages_per_seq
        if jax.process_count() > 1:  # every host must make the same pool: the least any host has room for
            from jax.experimental.multihost_utils import process_allgather

            free = 2**20 * int(np.min(process_allgather(np.array([free // 2**20], np.int32))))  # MiB: int32
        per_device = self.backend.cache_bytes_per_page(self._cache_shape(1)) // self.layout.size
        if self.draft_model is not None:  # a page holds the draft's keys and values too
            per_device += (self.backend.cache_bytes_per_page(self._cache_shape(1, self.draft_info, self.draft_layout))
                           // self.draft_layout.size)
        pages = capacity.pages_for_memory(free, self.config.kv_cache_memory_fraction, per_device)
        if pages < self.max_pages_per_seq + 1:
            raise ValueError(f"{free / 2**30:.2f} GiB left per device after the weights hold {pages} KV pages, "
                             f"fewer than one sequence of max_model_len={self.max_model_len} needs "
                             f"({self.max_pages_per_seq + 1}); lower max_model_len, raise kv_cache_memory_fraction "
                             "or tensor_parallel_size")
        logger.info("KV pool: %d pages of %d tokens (%d tokens, %.2f GiB per device) from %.0f%% of %.2f GiB free",
                    pages, self.page_size, pages * self.page_size, pages * per_device / 2**30,
                    100 * self.config.kv_cache_memory_fraction, free / 2**30)
        return pages

    def _lora_pool(self) -> Optional[LoraPool]:
        """The empty pool of `max_loras` slots, split over the mesh as the weights it adapts."""
        if self._lora_shape is None:
            return None
        with self._device_context():
            pool = sharding.place(LoraPool.zeros(self._lora_shape, jnp.dtype(self.dtype)), self.layout, self.mesh)
        shardings = jax.tree_util.tree_map(lambda a: a.sharding, pool)
        self._load_slot = jax.jit(load_slot, donate_argnums=(0,), out_shardings=shardings)
        logger.info("LoRA: %d slots of rank %d for %s (%.1f MiB)", self._lora_shape.slots, self._lora_shape.rank,
                    ", ".join(self._lora_shape.projections),
                    sum(a.nbytes for a in jax.tree_util.tree_leaves(pool)) / 2**20)
        return pool

    def _init_cache(self, info=None, layout=None):
        """The served model's KV pool (or that of `info` split as `layout`: the draft's)."""
        init = jax.jit(lambda: self.backend.init_cache(self._cache_shape(self.num_pages, info, layout)),
                       out_shardings=self._cache_sharding)
        return init()

    def _startup_line(self) -> str:
        d = self.describe()
        devices = ", ".join(str(device) for device in self.mesh.devices.flat)
        return (f"model on {d['num_devices']} device(s) [{devices}], mesh ({d['mesh']}), attention backend "
                f"{d['attention_backend']}, {d['dtype']} weights, {d['kv_cache_dtype']} KV cache of "
                f"{d['num_pages']} pages x {d['page_size']} tokens")

    def _no_previous_tokens(self) -> jax.Array:
        """The `prev_tokens` of a step that reads none. Made by a jitted function under the mesh, so
        that its type (shape, sharding and mesh) is a sampled-token array's: warm-up compiles with it,
        and a step that reads real tokens must hit the same executable, not compile its own."""
        with self._device_context():
            return jax.jit(lambda: jnp.zeros(self.buckets.max_samples, jnp.int32),
                           out_shardings=sharding.replicated(self.mesh))()

    def _device_context(self, mapping: Optional[dict[str, str]] = None):
        return _MeshContext(self.mesh, self.layout.axis_mapping if mapping is None else mapping)


def vocab_gather(mesh: Mesh, vocab_split: bool):
    """f(logits) -> logits computed where their slice of the vocabulary lives, then gathered: left
    to itself, XLA gathered a tied embedding's whole weight every step (500 MiB for Llama-3.2-1B)."""
    replicated = sharding.replicated(mesh)
    by_vocab = NamedSharding(mesh, PartitionSpec(None, sharding.MODEL_AXIS)) if vocab_split else replicated
    constrain = jax.lax.with_sharding_constraint
    return lambda logits: constrain(constrain(logits, by_vocab), replicated)


def serving_model(model, model_dir: str, info, layout: sharding.TensorParallelLayout, scan_layers: bool,
                  place=lambda tree: tree, quantization: Optional[str] = None) -> ServingModel:
    """The serving model a replica makes of a loaded levanter model (or its shapes): KV heads
    repeated as the layout needs, weights quantized as `quantization` says, the checkpoint's
    RoPE, the layers unrolled or stacked; `place` puts it (each unstacked layer as it is made) on
    its devices."""
    if layout.kv_repeats > 1:
        model = sharding.repeat_kv_heads(model, layout.kv_repeats)
    model = quantize_model(model, quantization)
    hf = read_hf_config(model_dir)
    rope, variant = Rope.from_hf_config(hf, info.head_dim), Variant.from_hf_config(hf, info.head_dim)
    return place(ServingModel.from_levanter(model, rope, scan_layers, place, variant))


def _types(tree: Any) -> Any:
    """The arrays of `tree` as their types (shape, dtype, sharding), to compile against while the
    arrays themselves are donated and replaced."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _to_host(tree: Any) -> Any:
    """Numpy copies of replicated device arrays: a whole array where this process holds it, else
    this process's first shard (every shard of a replicated array is the whole array)."""
    leaves = jax.tree_util.tree_leaves(tree)
    if all(leaf.is_fully_addressable for leaf in leaves):
        return jax.device_get(tree)
    return jax.tree_util.tree_map(lambda a: np.asarray(a.addressable_data(0)), tree)


class _MeshContext:
    """Enter the device mesh and an axis mapping (empty: every array replicated)."""

    def __init__(self, mesh: Mesh, mapping: dict[str, str]):
        self.mesh = mesh
        self.mapping = mapping

    def __enter__(self):
        self._mesh_cm = hax.partitioning.set_mesh(self.mesh)
        self._axes_cm = hax.axis_mapping(self.mapping)
        self._mesh_cm.__enter__()
        self._axes_cm.__enter__()

    def __exit__(self, *exc):
        self._axes_cm.__exit__(*exc)
        self._mesh_cm.__exit__(*exc)
