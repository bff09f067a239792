"""Shared fixtures: tiny random checkpoints, made once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.support import tiny_models  # noqa: E402 (after the environment transformers reads at import)

# tests/multidevice needs 4 host devices, set before jax starts: integration/test_tensor_parallel.py runs
# it in its own process (with JAX_SERVE_MULTIDEVICE=1), so this one keeps a single device.
collect_ignore = [] if os.environ.get("JAX_SERVE_MULTIDEVICE") else ["multidevice"]


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """`checkpoint_factory(family, **sizes)` -> directory of a tiny random checkpoint (cached)."""
    made: dict[tuple, Path] = {}

    def make(family: str = "llama", **kwargs) -> Path:
        key = (family, tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = tiny_models.make_checkpoint(tmp_path_factory.mktemp(f"ckpt-{family}"), family, **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def whisper_dir(tmp_path_factory) -> Path:
    """A tiny random multilingual Whisper checkpoint (tiny_models.make_whisper_checkpoint)."""
    return tiny_models.make_whisper_checkpoint(tmp_path_factory.mktemp("ckpt-whisper"))


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory) -> Path:
    """A tiny random LLaVA checkpoint (tiny_models.make_llava_checkpoint)."""
    return tiny_models.make_llava_checkpoint(tmp_path_factory.mktemp("ckpt-llava"))


@pytest.fixture(scope="session")
def llama_dir(checkpoint_factory) -> Path:
    return checkpoint_factory("llama")


def pytest_collection_modifyitems(config, items):
    """Each test's tier is its folder: unit, integration or multidevice (`-m "not integration"`)."""
    for item in items:
        tier = Path(str(item.fspath)).relative_to(Path(__file__).parent).parts[0]
        if tier in ("unit", "integration", "multidevice"):
            item.add_marker(tier)
