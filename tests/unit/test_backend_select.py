"""Which attention backend an engine runs: auto's choice, and the fallbacks that say why."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from engine.backends.cpu import kernels as cpu_kernels
from engine.backends.select import select_backend
from engine.config import EngineConfig

MESH = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))


def test_without_a_compiler_the_kernels_are_unavailable_and_say_why(tmp_path, monkeypatch, caplog):
    """A fresh kernel cache and a compiler that does not exist: loading fails with a warning
    naming the compiler, instead of raising (the process keeps XLA's ops)."""
    monkeypatch.setenv("JAX_SERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="engine.backends.cpu.kernels"):
        assert cpu_kernels._load.__wrapped__() is False  # the cached result of this process stays as it is
    assert "CPU kernels unavailable" in caplog.text and "no-such-compiler" in caplog.text
    assert list((tmp_path / "kernels").glob("*.so")) == []


def test_the_cpu_backend_gives_way_to_xla_with_a_warning(monkeypatch, caplog):
    from engine.backends.cpu.backend import CpuBackend

    monkeypatch.setattr(CpuBackend, "available", staticmethod(lambda: False))
    with caplog.at_level(logging.WARNING, logger="engine.backends.select"):
        backend = select_backend(EngineConfig(model="unused", attention_backend="cpu"), jnp.bfloat16, MESH, "model")
    assert backend.name == "xla"
    assert "needs an x86 CPU with AVX2 + FMA and a C++ compiler; running the xla backend" in caplog.text


def test_tensor_parallel_cpu_runs_on_xla_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.backends.select"):
        backend = select_backend(EngineConfig(model="unused", attention_backend="cpu", tensor_parallel_size=2),
                                 jnp.bfloat16, MESH, "model")
    assert backend.name == "xla" and "cannot shard over devices" in caplog.text


def test_auto_picks_the_cpu_kernels_on_an_x86_cpu_that_has_them(monkeypatch):
    from engine.backends.cpu.backend import CpuBackend

    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    monkeypatch.setattr(CpuBackend, "available", staticmethod(lambda: True))
    assert select_backend(EngineConfig(model="unused", compilation_cache_dir=None), jnp.bfloat16, MESH, "model").name == "cpu"
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    assert select_backend(EngineConfig(model="unused"), jnp.bfloat16, MESH, "model").name == "xla"
