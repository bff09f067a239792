"""serve_app.task_detection on local checkpoints and aliases: architectures (the hook), marker files,
model types, in that order; what cannot be read is the default task."""

from __future__ import annotations

import json

import pytest

from serve_app import task_detection
from serve_app.config import ModelConfig
from serve_app.task_detection import checkpoint_task, detect_task, marker_files


def checkpoint(directory, config, *files: str):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    for name in files:
        (directory / name).write_text("[]")
    return directory


@pytest.mark.parametrize("config, files, task", [
    ({"model_type": "whisper"}, (), "transcribe"),
    ({"model_type": "bert", "architectures": ["BertModel"]}, (), "embed"),
    ({"model_type": "mpnet"}, ("modules.json",), "embed"),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, (), "generate"),
    ({"model_type": ["llama"]}, (), "generate"),
    ("{not json", (), "generate"),
])
def test_local_checkpoints(tmp_path, config, files, task):
    assert detect_task(str(checkpoint(tmp_path / "ckpt", config, *files))) == task


def test_an_architecture_suffix_wins_over_marker_files_and_model_types(tmp_path, monkeypatch):
    classifier = checkpoint(tmp_path / "a", {"model_type": "bert", "architectures": ["BertForSequenceClassification"]})
    monkeypatch.setattr(task_detection, "ARCHITECTURE_TASKS", {})
    assert checkpoint_task(classifier) == "embed"  # bert
    monkeypatch.setattr(task_detection, "ARCHITECTURE_TASKS", {"ForSequenceClassification": "transcribe"})
    assert checkpoint_task(classifier) == "transcribe"
    assert checkpoint_task(checkpoint(tmp_path / "b", {"model_type": "bert"}, "modules.json")) == "embed"


def test_aliases_unreadable_paths_and_the_config(tmp_path):
    assert detect_task("all-minilm-l6-v2") == "embed"
    assert detect_task(str(tmp_path / "missing")) == "generate"
    assert "modules.json" in marker_files()
    whisper = checkpoint(tmp_path / "w", {"model_type": "whisper"})
    assert ModelConfig(model=str(whisper)).task == "transcribe"
    assert ModelConfig(model=str(whisper), levanter_model={"type": "llama"}, tokenizer="t").task == "generate"


def test_a_repo_id_that_cannot_be_read_is_the_default_task(caplog):
    # conftest sets HF_HUB_OFFLINE, and the cache has no such repo
    assert detect_task("test-org/not-cached", "v1") == "generate"
    assert "the task of test-org/not-cached@v1 cannot be read here" in caplog.text
