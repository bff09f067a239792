"""Which attention backend a replica runs: `attention_backend` in the engine config.

`auto` picks `cpu` on an x86 CPU (the project's kernels), `tpu` on TPUs (JAX's Pallas ragged
paged attention) and `xla` elsewhere (GPUs, other CPUs). A backend that cannot run as asked gives
way to `xla`, with a warning that says why: the CPU kernels need AVX2 + FMA and a C++ compiler,
and cannot shard over several devices.
"""

from __future__ import annotations

import logging
import platform
from pathlib import Path

from jax.sharding import Mesh

from engine.backends.base import AttentionBackend, platform_of
from engine.backends.cpu.backend import CpuBackend
from engine.backends.cpu.matmul_choice import MatmulChooser
from engine.backends.tpu import TpuBackend
from engine.backends.xla import XlaBackend
from engine.config import ATTENTION_BACKENDS, EngineConfig

logger = logging.getLogger(__name__)


def select_backend(config: EngineConfig, weight_dtype, mesh: Mesh, model_axis: str) -> AttentionBackend:
    """The backend `config.attention_backend` names (or auto picks), for weights of `weight_dtype`
    on the devices of `mesh` (tensor parallel over `model_axis`)."""
    name, tensor_parallel_size = config.attention_backend, config.tensor_parallel_size
    device = platform_of(mesh)
    if name == "auto":
        x86 = platform.machine().lower() in ("x86_64", "amd64")
        name = "tpu" if device == "tpu" else "cpu" if device == "cpu" and x86 else "xla"
    if name == "cpu" and tensor_parallel_size > 1 and not CpuBackend.shardable:
        logger.warning("the cpu attention backend's kernels cannot shard over devices; tensor_parallel_size=%d "
                       "runs on the xla backend", tensor_parallel_size)
        name = "xla"
    elif name == "cpu" and not CpuBackend.available():
        logger.warning("the cpu attention backend needs an x86 CPU with AVX2 + FMA and a C++ compiler; "
                       "running the xla backend")
        name = "xla"
    if name == "tpu" and device != "tpu":
        logger.info("the tpu backend on %s runs levanter's reference ragged paged attention (exact, slow)", device)
    if name != "cpu" and device == "cpu" and str(weight_dtype) == "bfloat16":
        logger.warning("bfloat16 on CPU without the cpu attention backend takes XLA's bf16 path, ~20x slower "
                       "than float32: use attention_backend: cpu (x86 with a C++ compiler) or set dtype: float32")
    if name == "cpu":
        local = config.compilation_cache_dir and "://" not in config.compilation_cache_dir  # a URL: time again
        cache = Path(config.compilation_cache_dir).expanduser() / "cpu_matmul.json" if local else None
        return CpuBackend(weight_dtype, MatmulChooser(cache, config.cpu_matmul))
    if name == "tpu":
        return TpuBackend(mesh, model_axis)
    if name == "xla":
        return XlaBackend(device)
    raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}")
