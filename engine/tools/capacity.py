"""The TPU generations the offline tools plan and compile for (engine.tools.aot), with the memory
each JAX device of them offers. The plan itself (weights and KV pool per device, the smallest
`tensor_parallel_size` that fits) is the runner's own check before it loads a weight
(engine.generate.runner.memory_plan); the AOT tool runs it against these figures.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TpuChip:
    """One TPU generation as the planner sees it."""

    name: str
    hbm_bytes: int
    """Memory per JAX device (one chip; v4 and v5p chips as one megacore device) that programs may
    use: what libtpu's compiler reports available, a little under the chip's HBM."""


TPU_CHIPS = {chip.name: chip for chip in (
    TpuChip("v4", int(30.75 * 2**30)),
    TpuChip("v5e", int(15.75 * 2**30)),
    TpuChip("v5p", int(95.74 * 2**30)),
    TpuChip("v6e", int(31.25 * 2**30)),
)}
"""The generations `jax-serve-aot` compiles for, by the name topologies start with (v5e:2x4)."""
