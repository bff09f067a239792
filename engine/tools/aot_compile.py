"""Compiling a replica's step programs for a TPU topology on a host without TPUs (the work behind
`jax-serve-aot`, engine.tools.aot).

Given a model's config.json (no weights), an engine config and a TPU topology (`v5e:2x4`,
`v5p:2x2x2`, multi-host slices included), it builds every step program of the `tpu` backend
exactly as a replica of that slice would: the same abstract model (engine.models.loading
`abstract_model`) split over the same mesh, the same KV cache, the same step arguments, the same
compile order and sampler variants (`StepPrograms.compile_bucket`), the real Pallas kernel for the
topology's TPU generation. libtpu compiles them; nothing runs.

Reported per program: compile seconds, bytes per chip from the executable's `memory_analysis()`
(arguments: weights, KV cache, step inputs; temporaries), and collectives per step; per config:
the weights per chip (from the arrays' shardings), the KV pool the planner sizes
(engine.generate.runner.memory_plan) and whether it all fits in the chip's HBM.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from typing import Optional

import haliax as hax
import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding

from engine.backends.tpu import TpuBackend
from engine.formats.checkpoint_config import model_info
from engine.generate.planner import draft_inputs, empty_step_plan
from engine.generate.runner import memory_plan, sharding
from engine.generate.runner.draft import DraftShape, DraftSteps
from engine.generate.runner.kv_pool import cache_shape
from engine.generate.runner.loader import serving_model
from engine.generate.runner.step_programs import CompiledProgram, StepPrograms, vocab_gather
from engine.models.loading import abstract_model, resolve_dtype
from engine.step.buckets import ShapeBuckets
from engine.step.plan import WARM_SAMPLER_SWITCHES
from engine.tools.capacity import TPU_CHIPS

logger = logging.getLogger(__name__)

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass
class ProgramReport:
    name: str
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    collectives: dict[str, int]
    """Collective operations one run executes (a loop's body counted once per iteration)."""
    resident_bytes: int = 0
    """Per chip, what stays on it beside the program's own arguments: with a draft model, the
    other model's weights and KV pool."""

    @property
    def peak_bytes(self) -> int:
        return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes
                + self.resident_bytes)


@dataclasses.dataclass
class AotReport:
    topology: str
    device_kind: str
    chips: int
    hosts: int
    tensor_parallel_size: int
    weight_bytes: int
    """Per chip, from the weights' shardings."""
    kv_bytes: int
    kv_pages: int
    kv_tokens: int
    sequences: int
    """Sequences of max_model_len the KV pool holds at once."""
    hbm_bytes: int
    planned_weight_bytes: int
    """Per chip, the planner's figure (engine.generate.runner.memory_plan), computed from the layout's axis
    mapping rather than from the arrays' shardings: the tests hold the two equal."""
    problem: Optional[str]
    """Why the config does not fit (None: it fits)."""
    fits_from: Optional[int]
    """The planner's smallest tensor_parallel_size that fits on this topology (None: none does)."""
    programs: list[ProgramReport]

    @property
    def peak_bytes(self) -> int:
        """Per chip, the most one program holds: its arguments (weights, KV pool, step inputs),
        outputs not aliased to them, temporaries and code."""
        return max((p.peak_bytes for p in self.programs), default=0)

    @property
    def planner_error(self) -> Optional[float]:
        """The planner's weights + KV pool over the compiled programs' peak, minus one (None where
        the plan does not fit: the programs then hold a one-sequence pool, not the plan's)."""
        planned = self.planned_weight_bytes + self.kv_bytes
        return planned / self.peak_bytes - 1 if self.programs and self.problem is None else None

    @property
    def fits(self) -> bool:
        return self.problem is None and self.peak_bytes <= self.hbm_bytes


def topology_devices(topology: str, chips_per_host: Optional[str] = None):
    """The devices of a TPU topology ("v5e:2x4"), in the order `jax.devices()` lists them on it.
    `chips_per_host` ("2x4"): the hosts' shape (default libtpu's for the generation, e.g. 2x2)."""
    generation = topology.split(":")[0]
    if generation not in TPU_CHIPS:
        raise ValueError(f"unknown TPU generation in {topology!r}; known: {', '.join(TPU_CHIPS)} (e.g. v5e:2x4)")
    options = {"chip_config_name": "megacore"} if generation == "v4" else {}  # one device per chip, as a v4 VM has
    if chips_per_host:
        shape = tuple(int(n) for n in chips_per_host.split("x"))
        options["chips_per_host_bounds"] = shape + (1,) * (3 - len(shape))
    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology, **options).devices
    return sorted(devices, key=lambda d: d.id)


def compile_for_topology(config, topology: str, chips_per_host: Optional[str] = None) -> AotReport:
    """Compile every step program of `config` (an EngineConfig; its model a directory with a
    config.json) for the `tensor_parallel_size` first chips of `topology` (see `topology_devices`)."""
    devices = topology_devices(topology, chips_per_host)
    hbm_bytes = TPU_CHIPS[topology.split(":")[0]].hbm_bytes
    size = config.tensor_parallel_size
    if size > len(devices):
        raise ValueError(f"tensor_parallel_size={size} needs {size} chips; {topology} has {len(devices)}")
    info = model_info(config.model)
    layout = sharding.plan_layout(info, size, config.expert_parallel_size)
    mesh = Mesh(np.array(devices[:size]).reshape(1, size), ("data", sharding.MODEL_AXIS))
    backend = TpuBackend(mesh, sharding.MODEL_AXIS)
    model = _sharded_model(config, layout, mesh, backend)
    weight_bytes = sum(_bytes_per_device(a) for a in jax.tree_util.tree_leaves(model))

    plan = memory_plan.plan(config, size, hbm_bytes, backend.cache_bytes_per_page)
    smallest = memory_plan.smallest_tensor_parallel(config, hbm_bytes, len(devices), backend.cache_bytes_per_page)
    pages_per_seq = plan.pages_per_sequence
    buckets = ShapeBuckets(config.max_num_seqs, config.max_num_batched_tokens, pages_per_seq, config.page_size,
                           config.max_drafts)
    # a config that does not fit still compiles, with one sequence's pool: the compiler has its say too
    cache, cache_sharding = _cache(config, info, layout, mesh, backend, max(plan.pages, pages_per_seq + 1))
    steps = StepPrograms(model, backend, mesh, cache_sharding, buckets.max_samples,
                         vocab_split=layout.size > 1 and layout.shard_vocab)
    draft = _draft(config, mesh, backend, buckets, max(plan.pages, pages_per_seq + 1))
    programs, problem = _compile_all(steps, buckets, cache, mesh, info.vocab_size, layout.axis_mapping, draft)
    if draft is not None:  # each model's programs run beside the other's weights and pool
        served = weight_bytes + sum(_bytes_per_device(a) for a in jax.tree_util.tree_leaves(cache))
        for program in programs:
            program.resident_bytes = served if program.name.startswith("draft") else draft.resident_bytes
        weight_bytes += draft.weight_bytes
    return AotReport(topology, devices[0].device_kind, len(devices), len({d.process_index for d in devices}), size,
                     weight_bytes, plan.kv_bytes, plan.pages, plan.kv_tokens, plan.sequences_at(plan.max_model_len),
                     hbm_bytes, plan.weight_bytes, plan.problem() or problem,
                     smallest.tensor_parallel_size if smallest else None, programs)


def _sharded_model(config, layout, mesh, backend):
    """The serving model a replica would build, as shapes placed on `mesh` (no weights)."""
    info = model_info(config.model)
    scan = backend.scan_layers if config.scan_layers is None else config.scan_layers
    model, _ = abstract_model(config.model, resolve_dtype(config.dtype, info),
                              lambda m: serving_model(m, config.model, info, layout, scan,
                                                      quantization=config.quantization), layout.split_parts)
    shardings = hax.partitioning.infer_resource_partitions(model, layout.axis_mapping, mesh=mesh)
    return jax.tree_util.tree_map(lambda a, s: _with_sharding(a, s or sharding.replicated(mesh)), model, shardings,
                                  is_leaf=lambda x: isinstance(x, hax.NamedArray))


@dataclasses.dataclass
class _Draft:
    """A draft model's programs and arguments, as shapes on the topology's mesh."""

    steps: object
    """engine.generate.runner.draft.DraftSteps"""
    cache: object
    weight_bytes: int
    """Per chip."""
    resident_bytes: int
    """Per chip: its weights and KV pool."""


def _draft(config, mesh, backend, buckets, pages: int) -> Optional[_Draft]:
    """The draft model's programs (speculative decoding with `method: draft_model`; its model a
    directory with a config.json), over the same pages as the served model's pool; else None."""
    if config.draft_model is None:
        return None
    draft_config = dataclasses.replace(config, model=config.draft_model, speculative=None)
    info = model_info(draft_config.model)
    layout = sharding.plan_layout(info, config.tensor_parallel_size, config.expert_parallel_size)
    model = _sharded_model(draft_config, layout, mesh, backend)
    cache, cache_sharding = _cache(draft_config, info, layout, mesh, backend, pages)
    shape = DraftShape(config.max_drafts, config.page_size)
    steps = DraftSteps(model, backend, shape, vocab_gather(mesh, layout.size > 1 and layout.shard_vocab),
                       cache_sharding)
    weights = sum(_bytes_per_device(a) for a in jax.tree_util.tree_leaves(model))
    return _Draft(steps, cache, weights, weights + sum(_bytes_per_device(a) for a in jax.tree_util.tree_leaves(cache)))


def _cache(config, info, layout, mesh, backend, pages: int):
    """(the KV cache of `pages` pages as shapes placed on `mesh`, its sharding)."""
    cache_sharding = NamedSharding(mesh, backend.cache_partition(sharding.MODEL_AXIS))
    dtype = config.kv_cache_dtype or resolve_dtype(config.dtype, info)
    shape = cache_shape(info, layout, config.page_size, pages, dtype)
    cache = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=cache_sharding),
                                   jax.eval_shape(lambda: backend.init_cache(shape)))
    return cache, cache_sharding


def _compile_all(steps, buckets, cache, mesh, vocab_size: int, axis_mapping,
                 draft: Optional[_Draft] = None) -> tuple[list[ProgramReport], Optional[str]]:
    """Every bucket's programs in the replica's compile order (with a draft model, its forward
    program per bucket and its propose program with the first); stops at the first the compiler
    refuses for want of memory (the others would be too), saying which."""
    replicated = sharding.replicated(mesh)
    place = lambda tree: jax.tree_util.tree_map(  # noqa: E731 -- the step's host inputs as replicated types
        lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype, sharding=replicated), tree)
    prev_tokens = jax.ShapeDtypeStruct((buckets.max_samples,), np.int32, sharding=replicated)
    programs, sampler_sizes = [], set()
    # No concrete mesh context (jax.set_mesh): levanter evaluates a few constants eagerly while
    # tracing, and eagerly on a mesh of TPUs this host does not have cannot run. Shardings come with
    # the arguments; the abstract mesh is there for shard_map (engine.layers.moe's expert parallelism).
    with hax.axis_mapping(axis_mapping), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        for bucket in buckets.compile_order():
            try:
                samplers = () if bucket.samples in sampler_sizes else WARM_SAMPLER_SWITCHES
                compiled = steps.compile_bucket(bucket, buckets, cache, prev_tokens, vocab_size, place, samplers)
                if draft is not None:
                    compiled += _compile_draft(draft, bucket, buckets, place, prev_tokens)
            except Exception as exc:  # noqa: BLE001 -- the compiler's word that a program cannot fit is a finding
                if "RESOURCE_EXHAUSTED" not in str(exc):
                    raise
                return programs, f"T={bucket.tokens} does not compile: {str(exc).splitlines()[0]}"
            for program in compiled:
                programs.append(_program_report(program))
                logger.info("%s compiled in %.1f s", program.name, program.seconds)
            sampler_sizes.add(bucket.samples)
    return programs, None


def _compile_draft(draft: _Draft, bucket, buckets, place, prev_tokens) -> list:
    """The draft's forward program for `bucket` and, for buckets up to a full batch of decodes,
    its propose program of as many rows."""
    start = time.perf_counter()
    inputs = place(empty_step_plan(bucket, buckets, step_id=-1).inputs)
    programs = [CompiledProgram(f"draft forward T={bucket.tokens}",
                                draft.steps.lower_forward(draft.cache, inputs, prev_tokens).compile(),
                                time.perf_counter() - start)]
    if bucket.tokens <= buckets.decode_bucket().tokens:
        start = time.perf_counter()
        propose = draft.steps.lower_propose(draft.cache, place(draft_inputs(buckets, [], ready=[bucket]))).compile()
        programs.append(CompiledProgram(f"draft propose R={bucket.tokens} x{draft.steps.num_tokens}", propose,
                                        time.perf_counter() - start))
    return programs


def _with_sharding(leaf, where):
    """A shape-only array (named or not) placed as `where` says."""
    if isinstance(leaf, hax.NamedArray):
        return dataclasses.replace(leaf, array=_with_sharding(leaf.array, where))
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where)


def _bytes_per_device(a) -> int:
    return int(np.prod(a.sharding.shard_shape(a.shape))) * np.dtype(a.dtype).itemsize


def _program_report(program) -> ProgramReport:
    memory = program.executable.memory_analysis()
    return ProgramReport(program.name, program.seconds, memory.argument_size_in_bytes, memory.output_size_in_bytes,
                         memory.alias_size_in_bytes, memory.temp_size_in_bytes, memory.generated_code_size_in_bytes,
                         count_collectives(program.executable.as_text()))


_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_COLLECTIVE = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_CALLED = re.compile(r"(calls|to_apply|body|condition|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_CONSTANT = re.compile(r"constant\((\d+)\)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def count_collectives(hlo: str) -> dict[str, int]:
    """Collectives one run of an optimized HLO module executes: each computation's own, plus those
    of the computations it calls: a while loop's body once per iteration (its known trip count,
    else the one bound its condition compares the counter with, as a fori_loop's is), the most
    of a conditional's branches."""
    own: dict[str, dict[str, int]] = {}
    calls: dict[str, list[tuple[str, list[str], object]]] = {}  # (kind, callees, trips: int or a condition)
    constants: dict[str, list[int]] = {}
    entry = current = None
    for line in hlo.splitlines():
        if match := _COMPUTATION.match(line):
            current = match.group(1)
            own[current], calls[current], constants[current] = {}, [], []
            entry = current if line.startswith("ENTRY") else entry
        elif current is not None:
            if match := _COLLECTIVE.search(line):
                own[current][match.group(1)] = own[current].get(match.group(1), 0) + 1
            constants[current] += [int(c) for c in _CONSTANT.findall(line)]
            found = {kind: [n.strip(" {}%") for n in names.split(",")] for kind, names in _CALLED.findall(line)}
            trip = _TRIP_COUNT.search(line)
            for kind, names in found.items():
                if kind == "body":
                    calls[current].append((kind, names, int(trip.group(1)) if trip else found["condition"][0]))
                elif kind != "condition":
                    calls[current].append((kind, names, 1))

    def iterations(trips) -> int:
        if isinstance(trips, int):
            return trips
        bounds = constants.get(trips, [])
        return bounds[0] if len(bounds) == 1 else 1

    def total(name: str) -> dict[str, int]:
        counts = dict(own.get(name, {}))
        for kind, names, trips in calls.get(name, []):
            each = [total(callee) for callee in names]
            if kind == "branch_computations":  # one branch runs: count the one with the most
                each = [max(each, key=lambda c: sum(c.values()), default={})]
            for called in each:
                for op, n in called.items():
                    counts[op] = counts.get(op, 0) + n * iterations(trips)
        return counts

    return total(entry) if entry else {}

