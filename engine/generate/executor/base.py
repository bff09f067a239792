"""The executor seam: what runs step plans for an engine, in this process or over several hosts.

`LLMEngine` sees only this surface; `make_executor` picks the implementation from the config:
`LocalExecutor` (engine.generate.executor.local: one process holds the model) or `MultiHostExecutor`
(engine.generate.executor.multihost: one `EngineWorker` per host of a replica). Both compile their step
programs in the same order and serve while the later ones compile, and both can defer a step's
sampling until its grammars' masks are known.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

from engine.config import EngineConfig
from engine.generate.runner.facts import RunnerFacts
from engine.step.buckets import Bucket
from engine.step.plan import DraftInputs, StepOutput, StepPlan

if TYPE_CHECKING:
    from engine.generate.runner.model_runner import ModelRunner


class Executor(Protocol):
    facts: RunnerFacts
    """What the engine plans with: the runner's (worker 0's over several hosts), unchanged."""
    runner: Optional[ModelRunner]
    """This process's runner, the seam through which tests and benchmarks inspect the device side
    (its model, cache, backend, LoRA pool; see ModelRunner); None where the model lives in other
    processes (several hosts). The engine itself never reads it."""

    def warmup(self, background: bool = True) -> float:
        """Compile the first step program (all with `background=False`); the rest compile in the
        background. Returns the seconds until the first was ready."""

    def ready_buckets(self) -> list[Bucket]:
        """The buckets a step may take now, smallest first (every host has compiled them)."""

    def compile_progress(self) -> tuple[int, int]:
        """(step programs compiled, step programs in all)."""

    def wait_compiled(self, timeout: Optional[float] = None) -> bool:
        """Block until every step program is compiled; True if all are."""

    def launch(self, plan: StepPlan, sample: bool = True) -> Any:
        """Dispatch a step without waiting for it; returns its handle. With `sample=False` only the
        forward pass goes, and `sample` must follow before the next launch."""

    def sample(self, handle: Any, allowed) -> None:
        """Dispatch the deferred sampling of the step last launched under the token bitmask
        `allowed` (i32[R, ceil(V / 32)])."""

    def load_adapter(self, slot: int, adapter: Any) -> None:
        """Put an adapter's factors (engine.formats.peft.LoraAdapter) into LoRA slot `slot`,
        after the steps launched so far."""

    def add_image(self, slot: int, pixels: Any) -> None:
        """Compute an image's features (preprocessed pixels f[3, H, W]) into image slot `slot`,
        after the steps launched so far."""

    def propose(self, draft: DraftInputs):
        """The draft model's guesses i32[S, num_tokens] after each row's last token
        (speculative decoding with a draft model; engine.generate.runner.draft), after the steps launched so far."""

    def fetch(self, handle: Any) -> StepOutput:
        """Wait for a launched step and read its results."""

    def check_alive(self) -> None:
        """Raise if a host of the replica is gone."""

    def shutdown(self) -> None:
        """Release what the executor started (worker processes); the engine is unusable after."""


def make_executor(config: EngineConfig) -> Executor:
    """The executor `config.num_hosts` asks for."""
    if config.num_hosts == 1:
        # heavy: the runner stack (jax, levanter) loads when an engine is made, not with this module
        from engine.generate.executor.local import LocalExecutor

        return LocalExecutor(config)
    from engine.generate.executor.multihost import MultiHostExecutor  # ray: a multi-host replica's alone

    return MultiHostExecutor(config)
