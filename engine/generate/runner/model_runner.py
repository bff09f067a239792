"""The device side of one engine: weights, the KV cache and the jitted step, in one process.

    StepPlan -> forward (donates the cache) -> sample -> StepOutput

`launch(plan)` dispatches a step and returns at once (XLA runs it asynchronously); `fetch` waits
for its sampled tokens. A step launched while the previous one still runs reads the tokens that
step is sampling straight from its device output (`StepInputs.prev_slot`), so the host never waits
between steps; a plan names the step it reads, and a runner that did not launch that step last
refuses it.

Devices: `tensor_parallel_size` devices form the mesh (engine.generate.runner.sharding); weights and the KV
cache are split over it, and the step's outputs (logits, sampled tokens, logprobs) come back
replicated. The attention backend (engine.backends) owns the cache and attention; the runner
never asks which one runs. The models come from the loader (engine.generate.runner.loader), the
pool's size from engine.generate.runner.kv_pool, the programs from engine.generate.runner.step_programs;
what the engine plans with leaves as one `RunnerFacts` (engine.generate.runner.facts).

Warm-up compiles the first step program, then the others in the background (engine.compiler),
each with the common sampler variants; `ready_buckets` says which a step may take. The rarer
variants (penalties, top-k/p filtering) and prompt logprobs compile on first use.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.multihost_utils import sync_global_devices
from jax.sharding import NamedSharding

from engine.backends.select import select_backend
from engine.compiler import StepCompiler, enable_compilation_cache
from engine.config import EngineConfig
from engine.formats.checkpoint_config import ModelInfo, model_info
from engine.formats.peft import LoraAdapter
from engine.generate.runner import kv_pool, memory_plan, sharding
from engine.generate.runner.draft import DraftShape, DraftSteps
from engine.generate.runner.facts import ImageLayout, RunnerFacts
from engine.generate.runner.loader import ModelLoader
from engine.generate.runner.sampler import SampleOutput
from engine.generate.runner.step_programs import ProgramWarmup, StepPrograms, StepTypes, vocab_gather
from engine.layers.lora import slot_arrays
from engine.models.loading import resolve_dtype
from engine.step.buckets import Bucket, ShapeBuckets
from engine.step.plan import DraftInputs, StepOutput, StepPlan

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


class ModelRunner:
    """One process's share of a replica's device work. Besides its methods, what tests and
    benchmarks may inspect (through the executor's `runner`): `facts`, `model` (the serving model
    as the backend prepared it), `cache`, `backend`, `lora` (the adapters' pool, or None) and
    `weights_host`."""

    def __init__(self, config: EngineConfig):
        self.config = config
        if config.compilation_cache_dir:
            enable_compilation_cache(config.compilation_cache_dir)
        info = model_info(config.model)
        self.dtype = resolve_dtype(config.dtype, info)
        self.kv_cache_dtype = config.kv_cache_dtype or self.dtype
        self.layout = sharding.plan_layout(info, config.tensor_parallel_size, config.expert_parallel_size)
        self.mesh = sharding.make_mesh(config.tensor_parallel_size)
        self.backend = select_backend(config, self.dtype, self.mesh, sharding.MODEL_AXIS)
        max_model_len = _max_model_len(config, info)
        self.buckets = ShapeBuckets(max_num_seqs=config.max_num_seqs,
                                    max_num_batched_tokens=config.max_num_batched_tokens,
                                    max_pages_per_seq=-(-max_model_len // config.page_size),
                                    page_size=config.page_size, max_drafts=config.max_drafts)
        memory = sharding.free_device_memory(self.mesh.devices.flat)
        if memory is not None:  # accelerators: refuse a config that cannot fit before loading a weight
            memory_plan.check_fits(config, memory, len(jax.devices()), self.backend.cache_bytes_per_page)
        scan_layers = self.backend.scan_layers if config.scan_layers is None else config.scan_layers
        info = self._load(ModelLoader(config, self.dtype, self.mesh, self.layout, self.backend, self.buckets,
                                      scan_layers))
        num_pages = self._make_pool(info, max_model_len)
        self._make_programs(info.vocab_size)
        self.facts = RunnerFacts(
            self.buckets, num_pages, max_model_len, info, () if self.lora is None else tuple(self.lora.a),
            self.backend.flat_step_tokens(config.max_num_batched_tokens), self._image_layout(),
            self._describe(num_pages))
        """What the engine plans with (the executors hand it up)."""
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
            self.images = self.vision.write(self.images, index, pixels)

    def load_adapter(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter`'s factors into LoRA slot `slot` (after the steps launched so far, which
        read the slot's previous adapter)."""
        arrays = slot_arrays(adapter, self._lora.shape, self.facts.info.num_kv_heads)
        index, arrays = self._global((np.asarray(slot, np.int32), arrays))
        with self._device_context():
            self.lora = self._lora.load(self.lora, index, arrays)

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
            sync_global_devices("jax-serve warm-up")
        return seconds

    def ready_buckets(self) -> list[Bucket]:
        """The buckets a step may take now (StepCompiler.ready)."""
        return self.compiler.ready()

    def _global(self, tree):
        """Host arrays as the step's replicated inputs. In one process jit takes numpy as it is; over
        several, each process builds the global array from its own copy (a `device_put` onto a global
        sharding would compare the processes' values every step)."""
        if jax.process_count() == 1:
            return tree
        replicated = sharding.replicated(self.mesh)
        return jax.tree_util.tree_map(lambda a: jax.make_array_from_process_local_data(replicated, a), tree)

    def _device_context(self):
        return sharding.mesh_context(self.mesh, self.layout.axis_mapping)

    # ---- start-up ----

    def _load(self, loader: ModelLoader) -> ModelInfo:
        """Load the served model, the draft model, the LoRA pool and the vision tower, in that order;
        returns the served model's ModelInfo."""
        served = loader.load()
        self.model = served.model
        self.weights_host: Optional[jax.Device] = loader.weights_host
        """The host CPU device the weights were made on before they were placed (quantized weights
        on a host whose CPU is not one of the devices), or None: made on the devices."""
        self.draft = loader.load_draft(served.info)
        """The draft model of speculative decoding (engine.generate.runner.draft), or None."""
        self._lora = loader.lora_slots(served.lora_shape)
        self.lora = None if self._lora is None else self._lora.pool
        """The LoRA adapters' pool on the devices (engine.layers.lora), or None without `max_loras`."""
        self.vision = loader.load_vision(served.info)
        """The vision tower, its pool of image features and the program writing into it
        (loader.VisionTower); None for a text-only model."""
        self.images = None if self.vision is None else self.vision.images
        return served.info

    def _make_pool(self, info: ModelInfo, max_model_len: int) -> int:
        """Make the KV pool (and the draft's, of the same pages) from the memory the models left;
        returns its pages."""
        self._cache_sharding = NamedSharding(self.mesh, self.backend.cache_partition(sharding.MODEL_AXIS))
        models = [(info, self.layout)] + ([] if self.draft is None else [(self.draft.info, self.draft.layout)])
        page_bytes = kv_pool.page_bytes_per_device(self.backend, models, self.config.page_size, self.kv_cache_dtype)
        num_pages = kv_pool.pool_pages(self.config, self.mesh.devices.flat, page_bytes,
                                       self.buckets.max_pages_per_seq, max_model_len)
        shapes = [kv_pool.cache_shape(i, layout, self.config.page_size, num_pages, self.kv_cache_dtype)
                  for i, layout in models]
        self.cache = kv_pool.init_cache(self.backend, shapes[0], self._cache_sharding)
        self.draft_cache = None if self.draft is None else kv_pool.init_cache(self.backend, shapes[1],
                                                                              self._cache_sharding)
        return num_pages

    def _make_programs(self, vocab_size: int) -> None:
        draft = self.draft
        self.draft_steps = None if draft is None else DraftSteps(
            draft.model, self.backend, DraftShape(self.config.max_drafts, self.config.page_size),
            vocab_gather(self.mesh, draft.layout.size > 1 and draft.layout.shard_vocab), self._cache_sharding)
        self.steps = StepPrograms(self.model, self.backend, self.mesh, self._cache_sharding, self.buckets.max_samples,
                                  vocab_split=self.layout.size > 1 and self.layout.shard_vocab)
        self._no_tokens = self._no_previous_tokens()
        self._last_step: Optional[int] = None
        self._last_tokens = self._no_tokens
        types = StepTypes(_types(self.cache), self._no_tokens, _types(self.lora), _types(self.images),
                          _types(self.draft_cache))
        warmup = ProgramWarmup(self.steps, self.draft_steps, self.buckets, vocab_size, types, self._global,
                               self._device_context)
        self.compiler = StepCompiler(self.buckets.compile_order(), warmup.compile_bucket,
                                     lambda b: f"({b.tokens} tokens, {b.samples} samples)")

    def _image_layout(self) -> Optional[ImageLayout]:
        if self.vision is None:
            return None
        return ImageLayout(self.vision.config.image_token_id, self.images.tokens_per_image, self.images.slots)

    def _describe(self, num_pages: int) -> dict[str, str]:
        """How this replica runs its model (logged at start; an info metric's labels)."""
        devices = list(self.mesh.devices.flat)
        return {
            "num_hosts": str(jax.process_count()),
            "attention_backend": self.backend.name,
            "dtype": self.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "quantization": self.config.quantization or "none",
            "tensor_parallel_size": str(self.layout.size),
            "expert_parallel_size": str(self.layout.size if self.layout.expert_parallel else 1),
            "num_devices": str(len(devices)),
            "device_kind": devices[0].device_kind,
            "mesh": ",".join(f"{name}={size}" for name, size in self.mesh.shape.items()),
            "page_size": str(self.config.page_size),
            "num_pages": str(num_pages),
            "speculative": "none" if self.config.speculative is None else self.config.speculative.method,
            "num_speculative_tokens": str(self.config.max_drafts),
            "draft_model": self.config.draft_model or "none",
        }

    def _startup_line(self) -> str:
        d = self.facts.description
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


def _max_model_len(config: EngineConfig, info: ModelInfo) -> int:
    """Tokens per sequence the replica serves (kv_pool.max_model_len); ValueError past the model's positions."""
    max_model_len = kv_pool.max_model_len(config, info)
    if max_model_len > info.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                         f"{info.max_position_embeddings}; lower max_model_len")
    return max_model_len


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
