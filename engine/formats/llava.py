"""A LLaVA checkpoint's decoder as a text checkpoint of its own, for the text engine's loader.

A `LlavaForConditionalGeneration` directory (config.json model_type "llava") keeps its decoder's
weights under a prefix (`language_model.` or `model.language_model.`) and its config under
`text_config`. `build(source, out)` writes, once, into a cache entry (engine.formats.model_sources):
  * config.json and model.safetensors of the decoder alone, under plain causal-LM names
    (engine.models.vision.language_model_files), which the engine loads as any Llama / Qwen2 /
    Mistral checkpoint;
  * the tokenizer, chat template and generation config files, copied;
  * `vision`: a link to the LLaVA directory itself (its tower, projector and preprocessor), for the
    image inputs.
So a LLaVA checkpoint serves text chat with its own decoder; images are not yet placed into prompts.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

COPIED = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
          "special_tokens_map.json", "added_tokens.json", "chat_template.json", "chat_template.jinja",
          "generation_config.json", "preprocessor_config.json", "processor_config.json")
"""Files of the LLaVA directory the text checkpoint carries as they are."""
VISION_LINK = "vision"


def is_llava(path: Path) -> bool:
    """Whether `path` holds a LLaVA checkpoint (by config.json's model_type)."""
    try:
        return json.loads((path / "config.json").read_text()).get("model_type") == "llava"
    except (OSError, ValueError, AttributeError):
        return False


def entry_name(path: Path) -> str:
    """The cache entry of `path`'s decoder: named after the directory, and the size and time of each
    weight file (a rewritten checkpoint gets a new entry)."""
    stamp = hashlib.sha256(str(path.resolve()).encode())
    for file in sorted(path.glob("*.safetensors")):
        info = file.stat()
        stamp.update(f"{file.name}:{info.st_size}:{info.st_mtime_ns}".encode())
    return f"llava-text-{path.name}-{stamp.hexdigest()[:12]}"


def build(source: Path, out: Path) -> None:
    """Write `source`'s decoder as a text checkpoint into `out` (see the module doc)."""
    from safetensors.numpy import save_file

    from engine.models.vision import language_model_files

    config, state = language_model_files(source)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tied = config.get("tie_word_embeddings") and state.get("lm_head.weight") is state.get("model.embed_tokens.weight")
    weights = {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in COPIED:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    (out / VISION_LINK).symlink_to(source.resolve(), target_is_directory=True)
