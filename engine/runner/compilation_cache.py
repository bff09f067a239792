"""XLA's persistent compilation cache, shared by every engine of a process."""

from __future__ import annotations

from pathlib import Path

import jax


def enable_compilation_cache(path: str) -> None:
    """Persist compiled executables (process-wide jax setting; the same path for every engine).
    A URL (`gs://bucket/dir`) goes to JAX as it is: the hosts of a slice can share one cache."""
    if "://" in path:
        directory = path
    else:
        local = Path(path).expanduser()
        local.mkdir(parents=True, exist_ok=True)
        directory = str(local)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
