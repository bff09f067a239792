"""XLA's persistent compilation cache, shared by every engine of a process."""

from __future__ import annotations

from pathlib import Path

import jax


def enable_compilation_cache(path: str) -> None:
    """Persist compiled executables (process-wide jax setting; the same path for every engine).
    A URL (`gs://bucket/dir`) goes to JAX as it is: the hosts of a slice can share one cache.

    A local directory keeps every program, down to the small ones that loading and packing the
    weights run once each (compiling them costs more than reading them back; docs/benchmarks.md).
    A URL keeps only those that took 0.5 s or more to compile: there a read is a round trip to the
    store."""
    if "://" in path:
        directory, min_compile_s = path, 0.5
    else:
        local = Path(path).expanduser()
        local.mkdir(parents=True, exist_ok=True)
        directory, min_compile_s = str(local), 0.0
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)
