"""One replica over several hosts: this process schedules, one `EngineWorker` per host computes.

    leader (LLMEngine: scheduler, step planner)  --StepPlan-->  EngineWorker 0 .. N-1 (Ray actors)
                                                 <--StepOutput--  worker 0

The workers form one `jax.distributed` job (worker 0 is the coordinator; its address reaches the
others through Ray) and hold the model split over all their devices (`tensor_parallel_size` in
all). Every step the leader puts the plan in Ray's object store once and each worker launches it:
the same jitted program on the same global mesh. Before launching, the workers compare the plan's
fingerprint (its id and every static shape) in a small all-gather, so hosts that would run different
programs fail loudly instead of computing garbage together. Steps stay overlapped as on one host:
one call per worker launches step N+1 and then returns step N's results, so the device runs N+1
while they travel back; tokens and logprobs come from worker 0 (every output is replicated). A
constrained step's sampling follows in a second call, once the leader has its grammars' masks.

Every worker compiles the step programs in the same order (engine.compiler), the first
before it serves and the rest in the background; each answer carries how many it has compiled, and
the leader plans with the buckets that every worker has.

Failure is a whole-group affair: a worker that dies, or a step that does not return within
`step_timeout_s`, raises here; the engine loop dies with it, the replica's health check fails, and
Ray Serve restarts the replica, whose workers (actors it owns) die with it.

The workers are placed on the hosts of one TPU slice (`tpu_version` + `tpu_topology`: Ray's
`SlicePlacementGroup` reserves the slice's head, then one bundle per host of that slice), else on
the bundles of the replica's placement group (one per host, after the leader's), else on a placement
group made here (an engine outside Ray Serve). Groups made here die with the leader.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
import ray
from jax.experimental.multihost_utils import process_allgather
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from ray.util.tpu import SlicePlacementGroup

from engine.config import EngineConfig
from engine.formats.model_sources import resolve_model
from engine.generate.runner.facts import RunnerFacts
from engine.generate.runner.model_runner import ModelRunner
from engine.step.buckets import Bucket
from engine.step.plan import StepOutput, StepPlan

logger = logging.getLogger(__name__)


class EngineWorker:
    """One host of a replica: its devices, its share of the weights, the steps the leader sends."""

    def __init__(self, config: EngineConfig, process_id: int):
        self.config = config
        self.process_id = process_id
        self.runner = None
        self._handles: dict[int, Any] = {}

    def fetch_model(self) -> str:
        """Make the checkpoint local to this host (see `local_model`); returns its directory."""
        self.config = local_model(self.config)
        return self.config.model

    def coordinator_address(self) -> str:
        """Worker 0 only: host:port of the `jax.distributed` coordinator it will start."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{_node_ip()}:{port}"

    def start(self, coordinator: str) -> dict:
        """Join the distributed job and load the model; returns what the leader needs (the runner's
        facts) and how this host started."""
        phases = {}
        start = time.perf_counter()
        timeout = int(self.config.step_timeout_s)
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=self.config.num_hosts,
                                   process_id=self.process_id, initialization_timeout=timeout,
                                   heartbeat_timeout_seconds=timeout)
        phases["distributed_init_s"] = time.perf_counter() - start
        start = time.perf_counter()
        self.runner = ModelRunner(self.config)
        phases["load_s"] = time.perf_counter() - start
        logger.info("engine worker %d: %d local of %d devices; %s", self.process_id, len(jax.local_devices()),
                    len(jax.devices()), ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
        return {"facts": self.runner.facts, "phases": phases, "pid": os.getpid(),
                "labels": dict(ray.get_runtime_context().get_node_labels())}

    def warmup(self, background: bool = True) -> float:
        return self.runner.warmup(background)

    def wait_compiled(self, timeout: Optional[float]) -> bool:
        return self.runner.compiler.wait(timeout)

    def compiled(self) -> list[str]:
        """The step programs compiled so far, in order (hosts must agree)."""
        return list(self.runner.compiler.fingerprints)

    def ping(self) -> int:
        return self._programs()

    def step(self, plan: Optional[StepPlan], fetch_step: Optional[int],
             sample: bool = True) -> tuple[Optional[StepOutput], int]:
        """Launch `plan` (if any; its sampling deferred with `sample=False`), then wait for step
        `fetch_step` (if any): one call per step. Returns (worker 0's outputs of `fetch_step`,
        step programs compiled here)."""
        if plan is not None:
            self.launch(plan, sample)
        output = None if fetch_step is None else self.fetch(fetch_step)
        return output, self._programs()

    def _programs(self) -> int:
        """Step programs compiled here; raises what a background compile raised."""
        self.runner.compiler.ready()
        return self.runner.compiler.progress()[0]

    def launch(self, plan: StepPlan, sample: bool = True) -> None:
        """Check that every host runs this very step, then dispatch it (returns before it ends)."""
        self._agree(plan)
        self._handles[plan.step_id] = self.runner.launch(plan, sample)

    def sample(self, step_id: int, allowed) -> None:
        """Dispatch the deferred sampling of step `step_id` under the token bitmask `allowed`."""
        self.runner.sample(self._handles[step_id], allowed)

    def load_adapter(self, slot: int, adapter) -> None:
        """Put a LoRA adapter's factors into slot `slot` of this host's share of the pool."""
        self.runner.load_adapter(slot, adapter)

    def add_image(self, slot: int, pixels) -> None:
        """Compute an image's features into slot `slot` of this host's image pool."""
        self.runner.add_image(slot, pixels)

    def propose(self, draft):
        """The draft model's guesses (every host runs the program; each returns the whole)."""
        return self.runner.propose(draft)

    def fetch(self, step_id: int) -> Optional[StepOutput]:
        """Wait for a launched step; worker 0 returns its outputs, the others None."""
        handle = self._handles.pop(step_id)
        if self.process_id == 0:
            return self.runner.fetch(handle)
        jax.block_until_ready(handle.out.tokens)
        return None

    def _agree(self, plan: StepPlan) -> None:
        mine = np.array([plan.step_id % 2**31, plan.fingerprint], np.int32)  # jax without x64: int32
        every = np.asarray(process_allgather(mine))
        disagree = [p for p, row in enumerate(every) if not np.array_equal(row, mine)]
        if disagree:
            raise RuntimeError(
                f"host {self.process_id}: step {plan.step_id} ({plan.bucket}) has fingerprint {plan.fingerprint}, but "
                f"hosts {disagree} hold (step, fingerprint) {[tuple(every[p]) for p in disagree]}: hosts must run "
                "identical steps in identical order (engine bug); restart the replica")


class MultiHostExecutor:
    """The leader's view of its workers: an `Executor` (engine.generate.executor.base)."""

    runner = None
    """The model lives in the workers' processes (see `Executor.runner`)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._timeout = config.step_timeout_s
        self._unfetched: Optional[int] = None  # the last step launched, while no call has fetched it
        self._answers: dict[int, list] = {}  # step id -> the calls that return its results
        self._compiled = 0  # step programs every worker has compiled
        self._samplings: dict[int, list] = {}  # step id -> its deferred sampling calls, checked at fetch
        self._loads: list = []  # adapter loads sent since the last fetch, checked at the next one
        start = time.perf_counter()
        group, first = self._placement()
        ray.get(group.ready(), timeout=self._timeout)
        actor = ray.remote(EngineWorker)
        self.workers = []
        for i in range(config.num_hosts):  # each worker takes its whole bundle (a host's chips)
            bundle = dict(group.bundle_specs[first + i])
            extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
            strategy = PlacementGroupSchedulingStrategy(group, first + i)
            self.workers.append(actor.options(num_cpus=bundle.get("CPU", 0), resources=extra,
                                              scheduling_strategy=strategy).remote(config, i))
        # no step timeout here: a host may download a large checkpoint first (each logs its progress)
        ray.get([w.fetch_model.remote() for w in self.workers])
        address = ray.get(self.workers[0].coordinator_address.remote(), timeout=self._timeout)
        started = ray.get([w.start.remote(address) for w in self.workers], timeout=self._timeout)
        self.facts: RunnerFacts = started[0]["facts"]
        self.worker_pids = [s["pid"] for s in started]
        self.worker_labels = [s["labels"] for s in started]
        """Each worker's node labels (a TPU host's slice name and worker id)."""
        logger.info("%d engine workers started in %.1f s (worker 0: %s)", config.num_hosts,
                    time.perf_counter() - start, ", ".join(f"{k} {v:.1f}" for k, v in started[0]["phases"].items()))

    def _placement(self):
        """(placement group, index of the first worker's bundle); see the module docstring."""
        config = self.config
        self._slice = self._own_group = None
        if config.tpu_topology:
            self._slice = SlicePlacementGroup(topology=config.tpu_topology, accelerator_version=config.tpu_version,
                                              head_reservation_timeout_s=self._timeout)
            if self._slice.num_hosts != config.num_hosts:
                self._slice.shutdown()
                raise ValueError(f"a {config.tpu_version} {config.tpu_topology} slice has {self._slice.num_hosts} "
                                 f"hosts; set num_hosts: {self._slice.num_hosts}")
            return self._slice.placement_group, 0
        group = ray.util.get_current_placement_group()
        if group is not None and group.bundle_count >= config.num_hosts + 1:
            return group, 1  # a Serve replica's own actor (the leader) holds bundle 0
        self._own_group = ray.util.placement_group([{"CPU": 1}] * config.num_hosts, strategy="PACK")
        return self._own_group, 0

    def check_alive(self) -> None:
        """Raise if a worker is gone, does not answer (its host lost, its process killed) or failed to
        compile a step program; an idle replica's compile progress moves on here."""
        self._note_compiled(ray.get([w.ping.remote() for w in self.workers], timeout=self._timeout))

    def warmup(self, background: bool = True) -> float:
        """Every worker compiles its first step program (the rest follow in the background, in the
        same order everywhere), then all start serving together behind a barrier."""
        seconds = max(ray.get([w.warmup.remote(background) for w in self.workers]))
        self._compiled = len(self.facts.buckets.all()) if not background else 1
        logger.info("%d engine workers ready to serve in %.1f s", len(self.workers), seconds)
        return seconds

    def ready_buckets(self) -> list[Bucket]:
        if self._compiled == 0:  # no warm-up: every bucket compiles on first use
            return self.facts.buckets.all()
        return sorted(self.facts.buckets.compile_order()[: self._compiled])

    def compile_progress(self) -> tuple[int, int]:
        return (self._compiled, len(self.facts.buckets.all())) if self._compiled else (0, 0)

    def wait_compiled(self, timeout: Optional[float] = None) -> bool:
        done = all(ray.get([w.wait_compiled.remote(timeout) for w in self.workers]))
        if done:
            self._compiled = len(self.facts.buckets.all())
        return done

    def compiled_programs(self) -> list[list[str]]:
        """Each worker's compiled step programs, in its order."""
        return ray.get([w.compiled.remote() for w in self.workers], timeout=self._timeout)

    def launch(self, plan: StepPlan, sample: bool = True) -> int:
        """Send the step to every worker; the step launched before it, not fetched yet, comes back
        with this call."""
        ref, previous = ray.put(plan), self._unfetched
        calls = [w.step.remote(ref, previous, sample) for w in self.workers]
        if previous is not None:
            self._answers[previous] = calls
        self._unfetched = plan.step_id
        return plan.step_id

    def sample(self, step_id: int, allowed) -> None:
        """Send a deferred sampling to every worker (Ray runs a caller's calls to an actor in order)."""
        ref = ray.put(allowed)
        self._samplings[step_id] = [w.sample.remote(step_id, ref) for w in self.workers]

    def add_image(self, slot: int, pixels) -> None:
        """Send an image's pixels to every worker, each computing its features into slot `slot`
        between the steps launched so far and the next; a failure surfaces at the next fetch."""
        ref = ray.put(pixels)
        self._loads += [w.add_image.remote(slot, ref) for w in self.workers]

    def load_adapter(self, slot: int, adapter) -> None:
        """Send an adapter's factors to every worker, between the steps launched so far and the
        next (Ray runs a caller's calls to an actor in order); a failure surfaces at the next fetch."""
        ref = ray.put(adapter)
        self._loads += [w.load_adapter.remote(slot, ref) for w in self.workers]

    def propose(self, draft):
        """Every worker runs the draft's propose program (after the steps sent so far); worker 0's guesses."""
        ref = ray.put(draft)
        return ray.get([w.propose.remote(ref) for w in self.workers], timeout=self._timeout)[0]

    def fetch(self, step_id: int) -> StepOutput:
        """Worker 0's outputs; raises if any worker failed the step or it took over step_timeout_s."""
        calls = self._answers.pop(step_id, None)
        if calls is None:  # nothing was launched after it: ask for it alone
            calls = [w.step.remote(None, step_id) for w in self.workers]
            self._unfetched = None
        loads, self._loads = self._loads, []
        answers = ray.get(loads + self._samplings.pop(step_id, []) + calls, timeout=self._timeout)[-len(calls):]
        self._note_compiled([compiled for _, compiled in answers])
        return answers[0][0]

    def _note_compiled(self, counts: list[int]) -> None:
        """The workers' step programs compiled: the leader plans with what every one has."""
        if self._compiled:  # 0: no warm-up, every bucket compiles on first use
            self._compiled = max(self._compiled, min(counts))

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        if self._own_group is not None:
            ray.util.remove_placement_group(self._own_group)
        if self._slice is not None:
            self._slice.shutdown()


def local_model(config: EngineConfig) -> EngineConfig:
    """`config` with `model` a checkpoint directory on this host: the leader's path where this host
    sees it too (the same host, a shared file system), else the source fetched into this host's
    cache (engine.formats.model_sources)."""
    if Path(config.model).is_dir() or config.source is None:
        return config
    logger.info("%s is not on this host; fetching %s", config.model, config.source.describe())
    return dataclasses.replace(config, model=str(resolve_model(config.source)))


def _node_ip() -> str:
    return ray.util.get_node_ip_address()
