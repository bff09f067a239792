"""Models from the Hugging Face Hub and from S3 (engine.formats.hub, engine.formats.object_store).

The Hub is tests/support/hub_server.py, a local server speaking the Hub's download API (`HF_ENDPOINT`);
huggingface_hub reads its endpoint, token and offline mode when imported, so every Hub resolution
runs in a fresh interpreter with the environment a replica would have. S3 is moto's server (a real
S3 endpoint over HTTP, `AWS_ENDPOINT_URL`), read through s3fs as in production.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.config import ModelSource
from engine.formats.checkpoint_files import needed_files
from engine.formats.model_sources import COMPLETE_MARKER, resolve_model
from tests.support.hub_server import HubServer
from tests.support.s3_server import S3Server

REPO = Path(__file__).parents[2]
JUNK = {"original/consolidated.00.pth": b"x" * 64, "model.Q4_K_M.gguf": b"g" * 64, "onnx/model.onnx": b"o",
        "README.md": b"# tiny", "pytorch_model.bin": b"b" * 64}
"""Files a real repo holds beside the checkpoint that the server must not fetch."""


def with_junk(checkpoint: Path, tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    shutil.copytree(checkpoint, repo)
    for name, data in JUNK.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(data)
    return repo


def test_needed_files_keep_what_the_server_loads():
    names = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
             "merges.txt", "chat_template.jinja", "generation_config.json", "modules.json", "1_Pooling/config.json",
             *JUNK, "original/params.json", "flax_model.msgpack", "tf_model.h5"]
    assert needed_files(names) == sorted([
        "1_Pooling/config.json", "chat_template.jinja", "config.json", "generation_config.json", "merges.txt",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
        "modules.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"])
    # PyTorch weights only where there are no safetensors
    assert needed_files(["config.json", "pytorch_model.bin", "README.md"]) == ["config.json", "pytorch_model.bin"]


def test_a_missing_shard_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="lacks the weight shards model-00002-of-00002.safetensors"):
        resolve_model(str(tmp_path))


# ---- the Hub ----


@pytest.fixture
def hub():
    server = HubServer()
    yield server
    server.close()


def resolve_in_fresh_process(spec: str, env: dict[str, str],
                             revision: str | None = None) -> subprocess.CompletedProcess:
    """resolve_model in a new interpreter (huggingface_hub reads its settings at import), logging to stderr."""
    code = textwrap.dedent(f"""
        import logging, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        from engine.config import ModelSource
        from engine.formats.model_sources import resolve_model
        print(resolve_model(ModelSource({spec!r}, revision={revision!r})))
    """)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, "PYTHONPATH": str(REPO), **env},
                          capture_output=True, text=True, timeout=120)


def hub_env(hub: HubServer, home: Path, **extra: str) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_DISABLE_PROGRESS_BARS": "1", **extra}


def resolved(proc: subprocess.CompletedProcess) -> Path:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


def test_a_repo_id_downloads_what_the_server_loads_once_into_the_hf_cache(hub, llama_dir, tmp_path):
    commit = hub.add("test-org/tiny-llama", with_junk(llama_dir, tmp_path))
    env = hub_env(hub, tmp_path / "hf")
    first = resolved(resolve_in_fresh_process("test-org/tiny-llama", env))
    assert first == tmp_path / "hf" / "hub" / "models--test-org--tiny-llama" / "snapshots" / commit
    served = sorted(str(p.relative_to(first)) for p in first.rglob("*") if p.is_file())
    assert served == sorted(needed_files([str(p.relative_to(llama_dir)) for p in llama_dir.rglob("*") if p.is_file()]))
    for name in served:
        assert (first / name).read_bytes() == (llama_dir / name).read_bytes()
    assert set(hub.downloads) == {("test-org/tiny-llama", name) for name in served}
    assert set(hub.downloads.values()) == {1}

    again = resolve_in_fresh_process("test-org/tiny-llama", env)
    assert resolved(again) == first
    assert set(hub.downloads.values()) == {1}, "a cached file was downloaded again"
    assert "fetched test-org/tiny-llama@main: config.json" in again.stderr  # each file logged


def test_offline_mode_and_an_unreachable_hub_serve_the_cached_snapshot(hub, llama_dir, tmp_path):
    hub.add("test-org/tiny-llama", llama_dir)
    env = hub_env(hub, tmp_path / "hf")
    first = resolved(resolve_in_fresh_process("test-org/tiny-llama", env))
    downloads = sum(hub.downloads.values())
    assert resolved(resolve_in_fresh_process("test-org/tiny-llama", {**env, "HF_HUB_OFFLINE": "1"})) == first
    assert sum(hub.downloads.values()) == downloads
    hub.close()
    unreachable = resolve_in_fresh_process("test-org/tiny-llama", env)
    assert resolved(unreachable) == first
    assert "serving test-org/tiny-llama@main from the Hugging Face cache" in unreachable.stderr

    missing = resolve_in_fresh_process("test-org/other", {**env, "HF_HUB_OFFLINE": "1"})
    assert missing.returncode == 1
    assert "ValueError: test-org/other@main is not in the Hugging Face cache" in missing.stderr
    assert "HF_HUB_OFFLINE is set" in missing.stderr


def test_a_revision_picks_a_branch_and_an_unknown_one_is_named(hub, llama_dir, tmp_path):
    hub.add("test-org/tiny-llama", llama_dir)
    v2 = tmp_path / "v2"
    shutil.copytree(llama_dir, v2)
    (v2 / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    commit = hub.add("test-org/tiny-llama", v2, branch="v2")
    env = hub_env(hub, tmp_path / "hf")
    path = resolved(resolve_in_fresh_process("test-org/tiny-llama", env, revision="v2"))
    assert path.name == commit
    assert json.loads((path / "generation_config.json").read_text()) == {"eos_token_id": 7}

    proc = resolve_in_fresh_process("test-org/tiny-llama", env, revision="nope")
    assert proc.returncode == 1
    assert "ValueError: test-org/tiny-llama has no revision 'nope' on " + hub.url in proc.stderr


def test_gated_and_unknown_repos_say_what_to_change(hub, llama_dir, tmp_path):
    hub.add("test-org/gated", llama_dir, token="hf_secret")
    env = hub_env(hub, tmp_path / "hf")
    proc = resolve_in_fresh_process("test-org/gated", env)
    assert proc.returncode == 1
    assert f"ValueError: test-org/gated on {hub.url} is gated" in proc.stderr and "set HF_TOKEN" in proc.stderr
    assert resolved(resolve_in_fresh_process("test-org/gated", {**env, "HF_TOKEN": "hf_secret"})).is_dir()

    proc = resolve_in_fresh_process("test-org/nothing-here", env)
    assert proc.returncode == 1
    assert ("ValueError: model 'test-org/nothing-here' is not a local directory, and " + hub.url +
            " has no repo of that name") in proc.stderr


def test_a_local_directory_wins_over_a_repo_id(tmp_path, monkeypatch, llama_dir):
    shutil.copytree(llama_dir, tmp_path / "org" / "name")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/name") == (tmp_path / "org" / "name").resolve()
    assert ModelSource("org/name").describe() == "org/name"
    monkeypatch.chdir(REPO)
    assert ModelSource("org/name", revision="v1").describe() == "org/name@v1"


# ---- S3 ----


@pytest.fixture
def s3(monkeypatch):
    """A moto S3 server; the environment points s3fs at it."""
    s3fs = pytest.importorskip("s3fs")
    with S3Server() as server:
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()  # fsspec reuses filesystems made with other settings
        yield server
    s3fs.S3FileSystem.clear_instance_cache()


def test_an_s3_prefix_is_copied_once_and_a_rewrite_gets_a_new_entry(s3, llama_dir, tmp_path, caplog):
    s3.upload(with_junk(llama_dir, tmp_path), "s3://models/team/tiny-llama")
    cache = tmp_path / "cache"
    first = resolve_model("s3://models/team/tiny-llama/", cache_dir=cache)
    assert first.parent == cache and first.name.startswith("s3-tiny-llama-")
    copied = sorted(str(p.relative_to(first)) for p in first.rglob("*") if p.is_file() and p.name != COMPLETE_MARKER)
    assert copied == sorted(needed_files([str(p.relative_to(llama_dir)) for p in llama_dir.rglob("*") if p.is_file()]))
    assert (first / "model.safetensors").read_bytes() == (llama_dir / "model.safetensors").read_bytes()
    marker = (first / COMPLETE_MARKER).read_text()
    assert resolve_model("s3://models/team/tiny-llama", cache_dir=cache) == first
    assert (first / COMPLETE_MARKER).read_text() == marker, "a cache hit was copied again"

    s3.put("s3://models/team/tiny-llama/generation_config.json", b'{"eos_token_id": 5}')
    second = resolve_model("s3://models/team/tiny-llama", cache_dir=cache)
    assert second != first and json.loads((second / "generation_config.json").read_text()) == {"eos_token_id": 5}


def test_an_unreachable_store_serves_the_newest_cached_copy(s3, llama_dir, tmp_path, monkeypatch, caplog):
    s3.upload(llama_dir, "s3://models/team/tiny-llama")
    cache = tmp_path / "cache"
    first = resolve_model("s3://models/team/tiny-llama", cache_dir=cache)
    import s3fs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed}")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3fs.S3FileSystem.clear_instance_cache()
    assert resolve_model("s3://models/team/tiny-llama", cache_dir=cache) == first
    assert "cannot list s3://models/team/tiny-llama" in caplog.text and "serving the newest cached copy" in caplog.text
    with pytest.raises(RuntimeError, match=r"cannot list s3://models/other.*the cache .* has no copy of it"):
        resolve_model("s3://models/other", cache_dir=cache)


def test_an_s3_prefix_without_a_checkpoint_is_named(s3, tmp_path):
    s3.put("s3://models/empty/readme.md", b"nothing")
    with pytest.raises(ValueError, match=r"s3://models/empty holds no config.json \(1 objects under it\)"):
        resolve_model("s3://models/empty", cache_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_host_without_the_leaders_directory_fetches_the_source(s3, llama_dir, tmp_path):
    """What each EngineWorker of a multi-host replica does before it loads (engine.generate.executor.multihost)."""
    from engine.config import EngineConfig
    from engine.generate.executor.multihost import local_model

    s3.upload(llama_dir, "s3://models/team/tiny-llama")
    source = ModelSource("s3://models/team/tiny-llama", cache_dir=str(tmp_path / "host-cache"))
    elsewhere = EngineConfig(model=str(tmp_path / "only-on-the-leader"), source=source)
    fetched = local_model(elsewhere)
    assert Path(fetched.model).parent == tmp_path / "host-cache"
    assert (Path(fetched.model) / "model.safetensors").read_bytes() == (llama_dir / "model.safetensors").read_bytes()
    shared = EngineConfig(model=str(llama_dir), source=source)
    assert local_model(shared) is shared  # a path this host sees (the same host, a shared disk) is used as is
