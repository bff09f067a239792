"""What the one-device engines (engine.embed.engine, engine.transcribe.engine) share around their
own model: they refuse a config that spans devices, keep compiled programs in the compilation
cache, compile their programs with a StepCompiler (under `warmup`, the first ones before they
serve and the rest in the background) and describe how they run in the same terms.
"""

from __future__ import annotations

import logging
from typing import Optional

import jax

from engine.compiler import StepCompiler, enable_compilation_cache
from engine.config import EngineConfig

logger = logging.getLogger(__name__)


class OneDeviceEngine:
    """Base of an engine whose model runs on one device. A subclass calls `__init__` first, builds
    its model, its `dtype` and its `compiler`, then calls `_ready`; `_facts` says what `describe`
    reports of its model."""

    task: str
    """How errors and logs name the engine ("embedding", "speech")."""
    programs_key: str
    """The key under which `describe` counts the programs (an info metric's label)."""
    dtype: str
    compiler: StepCompiler

    def __init__(self, config: EngineConfig):
        if config.tensor_parallel_size != 1 or config.num_hosts != 1:
            raise ValueError(f"the {self.task} engine runs on one device; set tensor_parallel_size: 1 and num_hosts: 1")
        if config.compilation_cache_dir:
            enable_compilation_cache(config.compilation_cache_dir)
        self.warmup_seconds: Optional[float] = None
        """Seconds until the first programs were ready (the rest compile in the background); None
        without warm-up."""

    def _ready(self, warmup: bool) -> None:
        """With `warmup`, compile the first programs now and the rest in the background
        (engine.compiler); log how the engine runs."""
        if warmup:
            self.warmup_seconds = self.compiler.start()
        logger.info("%s engine: %s", self.task, self.describe())

    def compile_progress(self) -> tuple[int, int]:
        """(programs compiled, programs in all); (0, 0) without warm-up (each compiles on first use). Thread-safe."""
        return self.compiler.progress()

    def describe(self) -> dict[str, str]:
        """How the engine runs its model (fixed at start; logged, and an info metric's labels)."""
        return {"dtype": self.dtype, **self._facts(), "devices": f"1 x {jax.devices()[0].device_kind}",
                self.programs_key: str(len(self.compiler.order))}

    def _facts(self) -> dict[str, str]:
        """What `describe` says of the model, between its dtype and its device."""
        raise NotImplementedError
