"""The one module that touches the device: model weights, the KV cache and the jitted step.

A step turns the scheduler's plan into fixed-shape arrays, runs the model over them and samples:

    plan -> StepInputs (padded to a bucket) -> forward (donates the cache) -> sample -> host

`launch` dispatches a step and returns at once (XLA runs it asynchronously); `fetch` waits for its
sampled tokens. A step launched while the previous one still runs reads the tokens that step is
sampling straight from its device output (`prev_slot`), so the host never waits between steps.

Shapes come from a small set of buckets so that XLA compiles each once:
- decode rows `Sd` and prefill rows `Sp` round up to powers of two; a step that has both pads
  its decode group to a quarter of the maximum or to the maximum (`mixed_decode_rows`), so mixed
  steps add only two shapes per `Sp`, and a few decodes beside a prompt chunk do not carry
  `max_num_seqs` padding rows through every layer and the LM head;
- pages per row `L` round up to powers of two from `min_bucket_pages`.
Warm-up compiles every (Sd, Sp, L) bucket at start, with the common sampler variants, and logs
the time; the rarer variants (penalties, top-k/p filtering) and prompt logprobs compile on first use.

The jitted functions are pure functions of (model, cache, arrays) under a haliax device mesh, so
that sharding the model over a mesh of several devices is a change of mesh and axis mapping only.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from pathlib import Path
from typing import NamedTuple, Optional

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from engine.attention import cpu_kernels
from engine.core.config import EngineConfig
from engine.model.loading import ModelInfo, load_model
from engine.model.paged_model import KVCache, ServingModel, StepInputs, forward, logits_at
from engine.core.pages import SCRATCH_PAGE
from engine.core.request import TokenLogprob
from engine.runner.sampler import SampleOutput, SamplingInputs, sample, token_logprobs
from engine.core.scheduler import Plan, Row

logger = logging.getLogger(__name__)

U32 = 2**32


class _ModelSteps:
    """The jitted functions that take the model. The model travels as its flat list of weight arrays
    (the treedef is closed over): flattening equinox modules in Python on every call costs ~1 ms a
    step, a list of arrays is flattened in C++."""

    def __init__(self, model: ServingModel):
        self.weights, treedef = jax.tree_util.tree_flatten(model)
        unflatten = functools.partial(jax.tree_util.tree_unflatten, treedef)

        @functools.partial(jax.jit, donate_argnums=(1,))
        def forward_step(weights, cache: KVCache, inputs: StepInputs, prev_tokens, prev_slot):
            model = unflatten(weights)
            # tokens the previous step is sampling (placeholders on the host) come from its output
            tokens = jnp.where(prev_slot >= 0, prev_tokens[jnp.maximum(prev_slot, 0)], inputs.tokens)
            hidden, cache = forward(model, cache, inputs._replace(tokens=tokens))
            # hidden leaves as a plain array: a NamedArray output is unflattened in Python per call
            return logits_at(model, hidden, inputs.sample_index).array, hidden.array, cache

        @jax.jit
        def prompt_logprobs_step(weights, hidden, index, targets):
            model = unflatten(weights)
            hidden = hax.named(hidden, ("position", model.embeddings.Embed))
            return token_logprobs(logits_at(model, hidden, index).array, targets)

        self._forward, self._prompt_logprobs = forward_step, prompt_logprobs_step

    def forward(self, cache: KVCache, inputs: StepInputs, prev_tokens, prev_slot):
        """(logits of the sampled rows, final hidden states f[position, embed], updated cache);
        donates `cache`. Token t with prev_slot[t] >= 0 is prev_tokens[prev_slot[t]]."""
        return self._forward(self.weights, cache, inputs, prev_tokens, prev_slot)

    def prompt_logprobs(self, hidden, index, targets):
        return self._prompt_logprobs(self.weights, hidden, index, targets)


@functools.partial(jax.jit, static_argnames=("variant", "rows"))
def _sample_step(logits, inputs: SamplingInputs, variant: "SamplerVariant", rows: int) -> SampleOutput:
    """Sample; tokens are padded to `rows` (every bucket's row count at most), so that the next
    step's forward takes them in one shape."""
    out = sample(logits, inputs, **variant._asdict())
    return out._replace(tokens=jnp.pad(out.tokens, (0, rows - out.tokens.shape[0])))


class SamplerVariant(NamedTuple):
    """Static switches of the sampler (see engine.runner.sampler)."""

    random: bool = False
    logprobs: bool = False
    penalize: bool = False
    filter: bool = False
    cpu_argmax: bool = False


WARM_SAMPLER_VARIANTS = (SamplerVariant(), SamplerVariant(random=True), SamplerVariant(random=True, logprobs=True))


@dataclasses.dataclass
class RowResult:
    """What one row of a step produced (meaningful for `token` only when the row samples)."""

    token: int
    logprob: Optional[TokenLogprob]
    prompt_logprobs: list[TokenLogprob]
    """For rows of a sequence that asked for prompt logprobs: one per prompt token this row
    predicts (tokens start+1 .. of the prompt)."""


@dataclasses.dataclass
class LaunchedStep:
    """A step dispatched to the device; `ModelRunner.fetch` waits for and reads its results."""

    plan: Plan
    sd: int
    slots: list[tuple[int, Row]]
    """(sampling slot, row) of every row, as `_sample_slots` lays them out."""
    out: SampleOutput
    """On device until fetched; `out.tokens` feeds the next step's placeholders."""
    logprobs: bool
    """Whether any row wants the logprobs of its sampled token."""
    prompt_logprobs: Optional[tuple]
    """(owners, targets, device arrays) of the prompt logprobs this step computes, if any."""

    @functools.cached_property
    def slot_of(self) -> dict[str, int]:
        """Sampling slot (index into out.tokens) of each sampling row, by request id."""
        return {row.seq.request_id: slot for slot, row in self.slots if row.samples}


def _sample_slots(plan: Plan, sd: int) -> list[tuple[int, Row]]:
    """(sampling row, plan row) pairs in `plan.rows` order: decode rows first, then prefill rows
    after the `sd` (padded) decode slots."""
    return [(i, row) for i, row in enumerate(plan.decode)] + [(sd + r, row) for r, row in enumerate(plan.prefill)]


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.compilation_cache_dir:
            _enable_compilation_cache(config.compilation_cache_dir)
        self.mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
        with self._device_context():
            model, self.info = load_model(config.model, config.dtype)
            packed = jnp.dtype(config.dtype) if config.cpu_kernels and cpu_kernels.available() else None
            self.model = ServingModel.from_levanter(model, config.scan_layers, packed)
            self.steps = _ModelSteps(self.model)
            logger.info("linear layers run on %s", "the CPU matmul kernel" if packed else "XLA's dot")
            if packed and config.scan_layers:
                logger.warning("scan_layers with the CPU kernels makes every step ~15x slower than unrolled "
                               "layers; set scan_layers: false")
            if not packed and jax.default_backend() == "cpu" and config.dtype == "bfloat16":
                logger.warning("bfloat16 on CPU without the CPU kernels takes XLA's bf16 path, ~20x slower than "
                               "float32: install g++ (see cpu_kernels) or set dtype: float32")
            self.vocab_size = model.Vocab.size
        self.max_model_len = config.max_model_len or min(self.info.max_position_embeddings, 4096)
        if self.max_model_len > self.info.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                             f"{self.info.max_position_embeddings}; lower max_model_len")
        self.page_size = config.page_size
        self.max_pages_per_seq = -(-self.max_model_len // self.page_size)
        self.num_pages = config.num_pages or 1 + config.max_num_seqs * self.max_pages_per_seq
        self.max_prefill_rows = _pow2(max(1, config.max_num_batched_tokens // config.prefill_chunk))
        self.max_decode_rows = _pow2(config.max_num_seqs)
        self.mixed_decode_rows = sorted({max(1, self.max_decode_rows // 4), self.max_decode_rows})
        self.max_rows = self.max_decode_rows + self.max_prefill_rows  # sampled rows of a step at most
        self.min_bucket_pages = min(self.max_pages_per_seq, _pow2(-(-256 // self.page_size)))
        self.page_buckets = self._page_buckets()
        self.cache = self._init_cache()
        with self._device_context():
            self._no_tokens = jnp.zeros(self.max_rows, jnp.int32)  # prev_tokens when nothing is in flight

    # ---- public ----

    def warmup(self) -> float:
        """Compile every shape bucket; returns the seconds it took."""
        start = time.perf_counter()
        buckets = self.buckets()
        for sd, sp, pages in buckets:
            self._run_empty(sd, sp, pages)
        seconds = time.perf_counter() - start
        logger.info("warm-up compiled %d buckets in %.1f s", len(buckets), seconds)
        return seconds

    def buckets(self) -> list[tuple[int, int, int]]:
        sd = [1 << i for i in range(self.max_decode_rows.bit_length())]
        sp = [1 << i for i in range(self.max_prefill_rows.bit_length())]
        shapes = [(d, 0) for d in sd] + [(0, p) for p in sp] + [(d, p) for d in self.mixed_decode_rows for p in sp]
        return [(d, p, pages) for (d, p), pages in itertools.product(shapes, self.page_buckets)]

    def launch(self, plan: Plan, previous: Optional[LaunchedStep] = None) -> LaunchedStep:
        """Dispatch one step without waiting for it. Rows whose last input token is still being
        sampled by `previous` (a placeholder on the host) take it from previous's output."""
        sd, sp, pages = self._bucket(plan)
        with self._device_context():
            inputs, prev_slot = self._step_inputs(plan, sd, sp, pages, previous)
            prev_tokens = previous.out.tokens if previous is not None else self._no_tokens
            logits, hidden, self.cache = self.steps.forward(self.cache, inputs, prev_tokens, prev_slot)
            slots = _sample_slots(plan, sd)
            sampling, variant = self._sampling_inputs(slots, sd + sp)
            out = _sample_step(logits, sampling, variant, self.max_rows)
            prompt_lps = self._launch_prompt_logprobs(plan, sd, hidden)
        return LaunchedStep(plan, sd, slots, out, variant.logprobs, prompt_lps)

    def fetch(self, step: LaunchedStep) -> list[RowResult]:
        """Wait for a launched step; results follow `step.plan.rows` order."""
        # each array fetched costs host time: the logprob arrays only when a row asked for them
        if step.logprobs:
            out = jax.device_get(step.out)
        else:
            out = SampleOutput(jax.device_get(step.out.tokens), None, None, None)
        prompt_lps = self._fetch_prompt_logprobs(step)
        # prompt_lps is keyed by prefill row (slot - sd); decode slots (< sd) have none
        return [self._row_result(row, slot, out, prompt_lps.get(slot - step.sd, []))
                for slot, row in step.slots]

    # ---- shapes ----

    def _page_buckets(self) -> list[int]:
        buckets, n = [], self.min_bucket_pages
        while n < self.max_pages_per_seq:
            buckets.append(n)
            n *= 2
        return buckets + [self.max_pages_per_seq]

    def _bucket(self, plan: Plan) -> tuple[int, int, int]:
        n_dec, n_pre = len(plan.decode), len(plan.prefill)
        sp = _pow2(n_pre) if n_pre else 0
        sd = (next(d for d in self.mixed_decode_rows if d >= n_dec) if sp else _pow2(n_dec)) if n_dec else 0
        needed = max(-(-(row.start + row.length) // self.page_size) for row in plan.rows)
        pages = next(b for b in self.page_buckets if b >= needed)
        return sd, sp, pages

    # ---- host-side arrays ----

    def _step_inputs(self, plan: Plan, sd: int, sp: int, num_pages: int,
                     previous: Optional[LaunchedStep]) -> tuple[StepInputs, np.ndarray]:
        chunk = self.config.prefill_chunk
        total = sd + sp * chunk
        tokens = np.zeros(total, np.int32)
        positions = np.zeros(total, np.int32)
        dest = np.full(total, SCRATCH_PAGE * self.page_size, np.int32)
        prev_slot = np.full(total, -1, np.int32)
        sample_index = np.zeros(sd + sp, np.int32)
        dec_pages, dec_lens = np.zeros((sd, num_pages), np.int32), np.zeros(sd, np.int32)
        pre_pages, pre_lens, pre_start = (np.zeros((sp, num_pages), np.int32), np.zeros(sp, np.int32),
                                          np.zeros(sp, np.int32))
        for i, row in enumerate(plan.decode):
            self._fill_row(row, i, tokens, positions, dest, prev_slot, previous)
            dec_pages[i, : len(row.seq.pages)] = row.seq.pages[:num_pages]
            dec_lens[i] = row.start + 1
            sample_index[i] = i
        for r, row in enumerate(plan.prefill):
            offset = sd + r * chunk
            self._fill_row(row, offset, tokens, positions, dest, prev_slot, previous)
            pre_pages[r, : len(row.seq.pages)] = row.seq.pages[:num_pages]
            pre_lens[r], pre_start[r] = row.start + row.length, row.start
            sample_index[sd + r] = offset + row.length - 1
        # numpy leaves: jit transfers them in C++ (jnp.asarray would dispatch an op per array)
        inputs = StepInputs(tokens, positions, dest, dec_pages, dec_lens, pre_pages, pre_lens, pre_start, sample_index)
        return inputs, prev_slot

    def _fill_row(self, row: Row, offset: int, tokens, positions, dest, prev_slot,
                  previous: Optional[LaunchedStep]) -> None:
        seq, start, end = row.seq, row.start, row.start + row.length
        if row.length == 1:  # a decode row: scalar stores (numpy's per-call cost dominates at batch 32)
            prompt_len = len(seq.prompt_ids)
            tokens[offset] = seq.prompt_ids[start] if start < prompt_len else seq.output_ids[start - prompt_len]
            positions[offset] = start
            dest[offset] = seq.pages[start // self.page_size] * self.page_size + start % self.page_size
        else:
            span = slice(offset, offset + row.length)
            pos = np.arange(start, end)
            tokens[span] = seq.token_ids[start:end]
            positions[span] = pos
            dest[span] = np.asarray(seq.pages)[pos // self.page_size] * self.page_size + pos % self.page_size
        if end > seq.num_known_tokens:  # reads the token `previous` is sampling
            slot = previous.slot_of.get(seq.request_id) if previous is not None else None
            if slot is None or end != seq.num_known_tokens + 1:
                raise RuntimeError(f"request {seq.request_id}: a planned token is pending without a step "
                                   "in flight to sample it (engine bug)")
            prev_slot[offset + row.length - 1] = slot

    def _sampling_inputs(self, rows: list[tuple[int, Row]], n: int) -> tuple[SamplingInputs, SamplerVariant]:
        temperature, top_p, min_p = np.zeros(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.float32)
        top_k, seed, position = np.zeros(n, np.int32), np.zeros(n, np.uint32), np.zeros(n, np.int32)
        for i, row in rows:
            params = row.seq.params
            temperature[i], top_k[i], top_p[i], min_p[i] = params.temperature, params.top_k, params.top_p, params.min_p
            seed[i], position[i] = row.seq.seed % U32, row.seq.num_tokens
        params = [row.seq.params for _, row in rows]
        variant = SamplerVariant(
            random=any(not p.greedy for p in params),
            logprobs=any(p.logprobs is not None for p in params),
            penalize=any(self._needs_dense(row) for _, row in rows),
            filter=any(p.needs_filtering and not p.greedy for p in params),
            cpu_argmax=self.model.packed,
        )
        inputs = SamplingInputs(temperature, top_k, top_p, min_p, seed, position)
        if variant.penalize:
            inputs = inputs._replace(**self._dense_inputs(rows, n))
        return inputs, variant

    def _needs_dense(self, row: Row) -> bool:
        seq = row.seq
        return seq.params.needs_penalties or len(seq.output_ids) < seq.params.min_tokens

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
                prompt_mask[i, np.asarray(seq.prompt_ids) % vocab] = True
            for token, value in params.logit_bias:
                bias[i, token] += value
            if len(seq.output_ids) < params.min_tokens:
                bias[i, [t for t in (*self.info.eos_token_ids, *params.stop_token_ids) if t < vocab]] = -np.inf
        arrays = dict(presence=presence, frequency=frequency, repetition=repetition, output_counts=counts,
                      prompt_mask=prompt_mask, bias=bias)
        return arrays

    # ---- prompt logprobs ----

    def _launch_prompt_logprobs(self, plan: Plan, sd: int, hidden) -> Optional[tuple]:
        """For prefill rows of sequences that asked for prompt logprobs: dispatch the logprobs of
        the prompt tokens each row's positions predict. None if no row asked."""
        wanted = [(r, row) for r, row in enumerate(plan.prefill) if row.seq.params.prompt_logprobs is not None]
        chunk, index, targets, owners = self.config.prefill_chunk, [], [], []
        for r, row in wanted:
            prompt = row.seq.prompt_ids
            for j in range(row.length):
                if row.start + j + 1 < len(prompt):
                    index.append(sd + r * chunk + j)
                    targets.append(prompt[row.start + j + 1])
                    owners.append(r)
        if not index:
            return None
        pad = _pow2(len(index)) - len(index)
        arrays = self.steps.prompt_logprobs(hidden, np.asarray(index + [0] * pad, np.int32),
                                            np.asarray(targets + [0] * pad, np.int32))
        return owners, targets, arrays

    def _fetch_prompt_logprobs(self, step: LaunchedStep) -> dict[int, list[TokenLogprob]]:
        """The launched prompt logprobs, keyed by prefill row index."""
        if step.prompt_logprobs is None:
            return {}
        owners, targets, arrays = step.prompt_logprobs
        chosen, top_ids, top_lps = jax.device_get(arrays)
        result: dict[int, list] = {}
        for k, r in enumerate(owners):
            top_n = step.plan.prefill[r].seq.params.prompt_logprobs
            result.setdefault(r, []).append(_token_logprob(targets[k], chosen[k], top_ids[k], top_lps[k], top_n))
        return result

    def _row_result(self, row: Row, index: int, out, prompt_lps: list) -> RowResult:
        token = int(out.tokens[index])
        k = row.seq.params.logprobs
        logprob = None if k is None else _token_logprob(token, out.logprobs[index], out.top_ids[index],
                                                        out.top_logprobs[index], k)
        return RowResult(token, logprob, prompt_lps)

    # ---- device ----

    def _device_context(self):
        return _MeshContext(self.mesh)

    def _init_cache(self) -> KVCache:
        info: ModelInfo = self.info
        dtype = KVCache.storage_dtype(self.config.kv_cache_dtype or self.config.dtype, kernels=self.model.packed)
        with self._device_context():
            return KVCache.init(info.num_layers, self.num_pages, self.page_size, info.num_kv_heads, info.head_dim, dtype)

    def _run_empty(self, sd: int, sp: int, num_pages: int) -> None:
        """Run a step of padding only (writes go to the scratch page) to compile its shapes. The
        arrays are made exactly as `launch` makes them, so the compiled step is the one reused."""
        tokens = sd + sp * self.config.prefill_chunk
        zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        n = sd + sp
        with self._device_context():
            inputs = StepInputs(zeros(tokens), zeros(tokens), zeros(tokens), zeros(sd, num_pages), zeros(sd),
                                zeros(sp, num_pages), zeros(sp), zeros(sp), zeros(n))
            sampling = SamplingInputs(np.zeros(n, np.float32), zeros(n), np.ones(n, np.float32),
                                      np.zeros(n, np.float32), np.zeros(n, np.uint32), zeros(n))
            no_slots = np.full(tokens, -1, np.int32)
            logits, _, self.cache = self.steps.forward(self.cache, inputs, self._no_tokens, no_slots)
            for variant in WARM_SAMPLER_VARIANTS:
                variant = variant._replace(cpu_argmax=self.model.packed)
                jax.block_until_ready(_sample_step(logits, sampling, variant, self.max_rows))

def _enable_compilation_cache(path: str) -> None:
    """Persist compiled executables (process-wide jax setting; the same path for every engine)."""
    directory = Path(path).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class _MeshContext:
    """Enter the device mesh and an empty axis mapping (single device: everything replicated)."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh

    def __enter__(self):
        self._mesh_cm = hax.partitioning.set_mesh(self.mesh)
        self._axes_cm = hax.axis_mapping({})
        self._mesh_cm.__enter__()
        self._axes_cm.__enter__()

    def __exit__(self, *exc):
        self._axes_cm.__exit__(*exc)
        self._mesh_cm.__exit__(*exc)


def _token_logprob(token: int, logprob, top_ids, top_lps, k: int) -> TokenLogprob:
    top = tuple((int(t), float(lp)) for t, lp in zip(top_ids[:k], top_lps[:k]))
    return TokenLogprob(int(token), float(logprob), top)

