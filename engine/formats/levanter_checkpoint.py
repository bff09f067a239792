"""Checkpoints levanter's checkpointer wrote (tensorstore, local or `gs://` / `s3://`), served.

A training run's checkpoint holds the trainer state (the model under `model/`, optimizer state,
step) but not the model's architecture nor its tokenizer: the model config names both, the
`model:` section of the training YAML (`{type: llama, hidden_dim: ..., ...}`) and the tokenizer the
run used (a local checkpoint directory, or a Hub repo id of which only the tokenizer files are
fetched). A path holding `step-*` checkpoints serves the newest one (levanter's own discovery).

The checkpoint is converted once, with levanter's own Hugging Face converter, into a cache entry
(engine.formats.model_sources) that everything else serves as any Hugging Face checkpoint: one
loader, one planner, one file set for every host. The entry's name carries a digest of the step's
path and write time, the model config and the tokenizer, so a newer step gets its own entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import fsspec
import yaml

from engine.config import is_repo_id
from engine.formats import hub
from engine.formats.transformers_files import load_tokenizer

logger = logging.getLogger(__name__)


def plan(checkpoint: str, levanter_model: dict[str, Any] | str, tokenizer: str) -> tuple[str, Callable[[Path], None]]:
    """(cache entry name, build(out) that writes the Hugging Face checkpoint into `out`)."""
    model = _model_section(levanter_model)
    step_dir, metadata = _latest_step(checkpoint)
    key = json.dumps([step_dir, metadata.get("timestamp"), model, tokenizer], sort_keys=True)
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", step_dir.rstrip("/").rsplit("/", 1)[-1])
    entry = f"levanter-{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    return entry, lambda out: _convert(step_dir, model, tokenizer, out)


def _model_section(levanter_model: dict[str, Any] | str) -> dict[str, Any]:
    """The model config as a dict: inline, or read from a YAML file (its `model:` key, if it has one)."""
    if isinstance(levanter_model, str):
        path = Path(levanter_model).expanduser()
        if not path.is_file():
            raise ValueError(f"levanter_model {levanter_model!r} is not a file: give the training config's YAML "
                             "file or its `model:` section inline")
        levanter_model = yaml.safe_load(path.read_text())
        if isinstance(levanter_model, dict) and isinstance(levanter_model.get("model"), dict):
            levanter_model = levanter_model["model"]
    if not isinstance(levanter_model, dict) or "type" not in levanter_model:
        raise ValueError("levanter_model must be the `model:` section of a levanter training config, with its "
                         f"`type` (llama, mistral, qwen, qwen3, ...); got {levanter_model!r}")
    return levanter_model


def _latest_step(checkpoint: str) -> tuple[str, dict]:
    """(the checkpoint directory to load, its metadata.json): `checkpoint` itself or its newest step."""
    from levanter.checkpoint import _load_metadata, discover_latest_checkpoint  # levanter (jax): heavy

    step_dir = discover_latest_checkpoint(checkpoint)
    if step_dir is None:
        raise ValueError(f"{checkpoint} holds no levanter checkpoint (no metadata.json in it or in a folder "
                         "under it): point `model` at a step directory or the run's checkpoint directory")
    return step_dir, _load_metadata(step_dir)


def _convert(step_dir: str, model_section: dict, tokenizer_spec: str, out: Path) -> None:
    # levanter (jax): heavy, and needed only to convert (every user of model_sources imports this module)
    import draccus
    import equinox as eqx
    import haliax as hax
    import jax
    from levanter.checkpoint import load_checkpoint
    from levanter.models.lm_model import LmConfig
    from levanter.utils.jax_utils import is_inexact_arrayish, local_cpu_mesh

    try:
        config = draccus.decode(LmConfig, model_section)
    except Exception as exc:
        raise ValueError(f"levanter_model is not a levanter model config: {exc}") from None
    tokenizer = load_tokenizer(str(_tokenizer_dir(tokenizer_spec)))
    Vocab = hax.Axis("vocab", _stored_vocab(step_dir) or len(tokenizer))
    logger.info("converting levanter checkpoint %s (%s, vocabulary %d, tokenizer %d)", step_dir,
                type(config).__name__, Vocab.size, len(tokenizer))
    with local_cpu_mesh():
        shapes = eqx.filter_eval_shape(config.build, Vocab, key=jax.random.PRNGKey(0))
        trainable, rest = eqx.partition(shapes, is_inexact_arrayish)
        try:
            trainable = load_checkpoint(trainable, step_dir, subpath="model", discover_latest=False)
        except Exception as exc:
            raise ValueError(f"{step_dir} does not hold a {type(config).__name__} of these sizes with a vocabulary "
                             f"of {Vocab.size}: {exc}. Check levanter_model and tokenizer against "
                             "the training config") from exc
        model = eqx.combine(trainable, rest)
        _save_hf(model, tokenizer, out)


def _stored_vocab(step_dir: str) -> int | None:
    """The vocabulary the run trained with, from the stored token embedding's array metadata (zarr 2
    or 3): levanter rounds the tokenizer's up so that it splits over the training mesh. None where
    the checkpoint lays it out otherwise (the tokenizer's length is then levanter's export default)."""
    weight = f"{step_dir.rstrip('/')}/model/embeddings/token_embeddings/weight"
    for name in (".zarray", "zarr.json"):
        try:
            with fsspec.open(f"{weight}/{name}", "r") as f:
                return int(json.load(f)["shape"][0])
        except (FileNotFoundError, KeyError, IndexError, ValueError):
            continue
    return None


def _save_hf(model, tokenizer, out: Path) -> None:
    """Write `model` as a Hugging Face checkpoint with levanter's converter. The converter takes
    config keys and the tokenizer from a reference checkpoint: the model's own config and the
    tokenizer, written beside (levanter's defaults name Hub repos)."""
    from transformers import AutoModelForCausalLM  # heavy: needed only to convert

    reference = out / ".reference"
    hf_config = model.config.to_hf_config(model.Vocab.size)
    hf_config.architectures = [AutoModelForCausalLM._model_mapping[type(hf_config)].__name__]
    hf_config.save_pretrained(reference)
    tokenizer.save_pretrained(reference)
    converter = model.config.hf_checkpoint_converter(ref_checkpoint=str(reference))
    converter.save_pretrained(model, str(out), save_reference_code=False, save_tokenizer=True)
    shutil.rmtree(reference)


def _tokenizer_dir(spec: str) -> Path:
    """A local directory holding the tokenizer `spec` names (a Hub repo: its tokenizer files only)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if is_repo_id(spec):
        return hub.fetch(spec, tokenizer_only=True)
    raise ValueError(f"tokenizer {spec!r} is neither a local directory nor a Hugging Face repo id")
