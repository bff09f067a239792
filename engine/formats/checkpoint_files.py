"""Which files of a remote Hugging Face checkpoint the server needs, and whether a local one is whole.

A Hub repo or a bucket prefix often holds more than a checkpoint: the original consolidated weights,
GGUF and ONNX exports, TensorFlow / Flax weights, images. The server fetches only what it loads:
config.json, the tokenizer and chat template files, generation_config.json, the sentence-transformers
layout (modules.json and its numbered module folders) and the weights, safetensors where there are
any, else PyTorch .bin files. Pure Python.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path, PurePosixPath

_TOP_LEVEL = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken")
"""Top-level files kept: configs, tokenizer files (vocab.txt, merges.txt, tokenizer.model, ...),
chat templates, safetensors weights. `pytorch_model*.bin` only where there are no safetensors."""
_MODULE_FOLDER = "[0-9]_*"
"""A sentence-transformers module folder (1_Pooling, 2_Normalize): its *.json configs are kept."""
_TORCH_WEIGHTS = "pytorch_model*.bin"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def needed_files(names: list[str]) -> list[str]:
    """The subset of a checkpoint's file names (relative, '/'-separated) that the server loads."""
    has_safetensors = any(fnmatch.fnmatch(name, "*.safetensors") and "/" not in name for name in names)
    keep = []
    for name in names:
        parts = PurePosixPath(name).parts
        if len(parts) == 1:
            wanted = any(fnmatch.fnmatch(name, p) for p in _TOP_LEVEL)
            wanted = wanted or (not has_safetensors and fnmatch.fnmatch(name, _TORCH_WEIGHTS))
        else:
            wanted = len(parts) == 2 and fnmatch.fnmatch(parts[0], _MODULE_FOLDER) and parts[1].endswith(".json")
        if wanted:
            keep.append(name)
    return sorted(keep)


def tokenizer_files(names: list[str]) -> list[str]:
    """The subset of a checkpoint's file names that a tokenizer (and its chat template) needs."""
    return [name for name in needed_files(names) if not name.endswith((".safetensors", ".bin"))
            and name != SAFETENSORS_INDEX]


def missing_shards(path: Path) -> list[str]:
    """Weight shards that `path`'s safetensors index names but the directory lacks (an interrupted
    download, a partial copy)."""
    index = path / SAFETENSORS_INDEX
    if not index.is_file():
        return []
    shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
    return [shard for shard in shards if not (path / shard).is_file()]
