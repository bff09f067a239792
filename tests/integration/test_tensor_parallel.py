"""Tensor parallelism. tests/multidevice runs in its own pytest process with 4 host CPU devices
(the rest of the suite keeps one); the checks here need one device."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.generate.engine import LLMEngine

TESTS = Path(__file__).parents[1]


def test_the_multidevice_suite_passes_on_four_host_devices():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "JAX_SERVE_MULTIDEVICE": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "multidevice")],
                          env=env, capture_output=True, text=True, timeout=1500, cwd=TESTS.parent)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]
    assert re.fullmatch(r"=* ?38 passed.*", summary), summary  # nothing skipped, nothing deselected


def test_heads_that_do_not_split_are_refused_with_what_to_change(llama_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        LLMEngine(EngineConfig(model=str(llama_dir), tensor_parallel_size=3, warmup=False))


def test_more_devices_than_this_process_has_are_refused(llama_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 devices; this process sees 1 .*"
                                         "xla_force_host_platform_device_count=2"):
        LLMEngine(EngineConfig(model=str(llama_dir), tensor_parallel_size=2, warmup=False))
