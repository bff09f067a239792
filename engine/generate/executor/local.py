"""One process holds the whole model: the executor is this process's `ModelRunner`."""

from __future__ import annotations

from typing import Optional

from engine.config import EngineConfig
from engine.generate.runner.model_runner import ModelRunner, StepHandle
from engine.step.plan import StepOutput, StepPlan


class LocalExecutor:
    """The `Executor` of a one-host replica: every call goes straight to the runner."""

    def __init__(self, config: EngineConfig):
        self.runner = ModelRunner(config)
        self.facts = self.runner.facts

    def warmup(self, background: bool = True) -> float:
        return self.runner.warmup(background)

    def ready_buckets(self):
        return self.runner.ready_buckets()

    def compile_progress(self) -> tuple[int, int]:
        return self.runner.compiler.progress()

    def wait_compiled(self, timeout: Optional[float] = None) -> bool:
        return self.runner.compiler.wait(timeout)

    def launch(self, plan: StepPlan, sample: bool = True) -> StepHandle:
        return self.runner.launch(plan, sample)

    def sample(self, handle: StepHandle, allowed) -> None:
        self.runner.sample(handle, allowed)

    def load_adapter(self, slot: int, adapter) -> None:
        self.runner.load_adapter(slot, adapter)

    def add_image(self, slot: int, pixels) -> None:
        self.runner.add_image(slot, pixels)

    def propose(self, draft):
        return self.runner.propose(draft)

    def fetch(self, handle: StepHandle) -> StepOutput:
        return self.runner.fetch(handle)

    def check_alive(self) -> None:
        """One process: alive as long as this process is."""

    def shutdown(self) -> None:
        """Stop compiling; the model itself lives as long as this process."""
        self.runner.compiler.stop()
