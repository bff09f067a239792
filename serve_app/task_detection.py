"""What task a model serves when its config says `task: auto`, read from its checkpoint on the
machine that builds the app (before any replica starts): a local directory's files, a Hub repo's
(config.json and the marker files it lists, fetched alone; with the Hub out of reach, the cached
snapshot's), or a builtin alias's declared task.

A checkpoint's task is, in this order: the task of the first `ARCHITECTURE_TASKS` suffix one of
config.json's `architectures` ends with; the first task of serve_app.tasks whose marker file it has
or whose model types hold its config.json `model_type`; else the default task. A source that cannot
be read here is served as the default task: its replicas then fail to start with the reason, and
the app's other models still serve.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

from engine.config import names_repo
from engine.formats import hub
from engine.formats.builtin_models import builtin_task
from serve_app.tasks import DEFAULT_TASK, SCORE, TASKS

logger = logging.getLogger(__name__)

ARCHITECTURE_TASKS: dict[str, str] = {"ForSequenceClassification": SCORE}
"""config.json `architectures` suffixes (e.g. "ForSequenceClassification") and the task their
checkpoints serve, tried before marker files and model types: the place of a task whose checkpoints
share their model_type with another task's (a BERT cross-encoder is `bert`, as an embedder is)."""


def detect_task(spec: str, revision: Optional[str] = None) -> str:
    """The task of the model `spec` (a local directory, a builtin alias or a Hub repo id at
    `revision`); the default task for anything this machine cannot read."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return checkpoint_task(path)
    alias_task = builtin_task(spec)
    if alias_task is not None:
        return alias_task
    if names_repo(spec):
        return _hub_task(spec, revision)
    return DEFAULT_TASK


def checkpoint_task(checkpoint: Path) -> str:
    """The task of a checkpoint directory (see the module's docstring for the order)."""
    config = _config(checkpoint)
    architectures = config.get("architectures") or ()
    for suffix, task in ARCHITECTURE_TASKS.items():
        if any(str(name).endswith(suffix) for name in architectures):
            return task
    model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else None
    for task in TASKS.values():
        if any((checkpoint / name).is_file() for name in task.marker_files) or model_type in task.model_types:
            return task.name
    return DEFAULT_TASK


def marker_files() -> tuple[str, ...]:
    """Every file whose presence says a task (serve_app.tasks' marker files)."""
    return tuple(dict.fromkeys(name for task in TASKS.values() for name in task.marker_files))


def _hub_task(repo_id: str, revision: Optional[str]) -> str:
    try:
        snapshot = hub.fetch_files(repo_id, revision, ("config.json", *marker_files()))
    except (ValueError, RuntimeError, OSError) as exc:
        logger.warning("the task of %s@%s cannot be read here (%s); it is served as %s: set `task` in its config "
                       "if that is wrong", repo_id, revision or "main", exc, DEFAULT_TASK)
        return DEFAULT_TASK
    return checkpoint_task(snapshot)


def _config(checkpoint: Path) -> dict[str, Any]:
    """config.json ({} where it cannot be read)."""
    try:
        config = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
