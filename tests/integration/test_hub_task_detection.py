"""Hub repo ids choose their task as local directories do, read on the machine that builds the app
from the Hub's config.json and file list (only those files downloaded), else from the cached
snapshot. The Hub is tests/support/hub_server.py; each detection runs in a fresh interpreter
(huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE when it is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.hub_server import HubServer

REPO = Path(__file__).parents[2]
REPOS = {
    "test-org/tiny-whisper": ({"model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"]}, ()),
    "test-org/mpnet-embedder": ({"model_type": "mpnet", "architectures": ["MPNetModel"]}, ("modules.json",)),
    "test-org/tiny-llama": ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, ()),
}


@pytest.fixture
def hub(tmp_path):
    server = HubServer()
    for repo_id, (config, markers) in REPOS.items():
        directory = tmp_path / "repos" / repo_id
        directory.mkdir(parents=True)
        (directory / "config.json").write_text(json.dumps(config))
        (directory / "model.safetensors").write_bytes(b"weights, never fetched to detect a task")
        (directory / "tokenizer.json").write_text("{}")
        for name in markers:
            (directory / name).write_text("[]")
        server.add(repo_id, directory)
    yield server
    server.close()


def detect_in_fresh_process(specs: list[str], env: dict[str, str]) -> dict[str, str]:
    code = textwrap.dedent(f"""
        import json, logging, sys
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        from serve_app.config import ModelConfig
        print(json.dumps({{spec: ModelConfig(model=spec).task for spec in {specs!r}}}))
    """)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    proc = subprocess.run([sys.executable, "-c", code], env={**clean, "PYTHONPATH": str(REPO), **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_repo_ids_choose_their_task_from_the_hub_then_from_the_cache(hub, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    want = {"test-org/tiny-whisper": "transcribe", "test-org/mpnet-embedder": "embed",
            "test-org/tiny-llama": "generate"}
    assert detect_in_fresh_process(list(REPOS), env) == want
    assert set(hub.downloads) == {(repo, "config.json") for repo in REPOS} | {("test-org/mpnet-embedder",
                                                                               "modules.json")}
    hub.close()  # unreachable: the cached snapshots answer
    assert detect_in_fresh_process(list(REPOS), env) == want
    assert detect_in_fresh_process(list(REPOS), {**env, "HF_HUB_OFFLINE": "1"}) == want
