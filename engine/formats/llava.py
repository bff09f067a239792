"""LLaVA checkpoints' files: their configs, where their weights sit, and their decoder as a text
checkpoint of its own, for the text engine's loader. Pure Python, numpy and safetensors (no jax): the
vision tower itself is engine.models.vision, which reads its weights through `Layout` and
`read_tensors` here.

A `LlavaForConditionalGeneration` directory (config.json model_type "llava": `vision_config`,
`text_config`, ...) holds safetensors weights, one file or shards with model.safetensors.index.json,
under either key layout (`Layout`): transformers >= 4.52's in-memory names
(`model.vision_tower.vision_model.…`, `model.multi_modal_projector.…`, `model.language_model.…`,
`lm_head.weight`) or the older ones that transformers 4 still writes (`vision_tower.vision_model.…`,
`multi_modal_projector.…`, `language_model.model.…`, `language_model.lm_head.weight`).

`build(source, out)` writes, once, into a cache entry (engine.formats.model_sources):
  * config.json and model.safetensors of the decoder alone, under plain causal-LM names
    (`language_model_files`), which the engine loads as any Llama / Qwen2 / Mistral checkpoint;
  * the tokenizer, chat template and generation config files, copied;
  * `vision`: a link to the LLaVA directory itself (its tower, projector and preprocessor), for the
    image inputs.
So a LLaVA checkpoint serves text chat with its own decoder; images are not yet placed into prompts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers numpy's bfloat16, which safetensors' numpy reader needs)
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from engine.formats.checkpoint_config import read_hf_config
from engine.formats.transformers_files import hf_config

COPIED = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
          "special_tokens_map.json", "added_tokens.json", "chat_template.json", "chat_template.jinja",
          "generation_config.json", "preprocessor_config.json", "processor_config.json")
"""Files of the LLaVA directory the text checkpoint carries as they are."""
VISION_LINK = "vision"
TOWERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
"""vision_config.model_type -> the tower's kind."""
_TEXT_MODELS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
"""text_config.model_type -> its causal-LM class: the decoders whose weights are `model.*` + `lm_head`."""
_LLAVA_DEFAULT_VISION = {"model_type": "clip_vision_model", "intermediate_size": 4096, "hidden_size": 1024,
                         "patch_size": 14, "image_size": 336, "num_hidden_layers": 24, "num_attention_heads": 16}
"""The tower `LlavaConfig` assumes when config.json has no vision_config (CLIP ViT-L/14 at 336 px)."""


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
    config, state = language_model_files(source)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tied = config.get("tie_word_embeddings") and state.get("lm_head.weight") is state.get("model.embed_tokens.weight")
    weights = {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in COPIED:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    (out / VISION_LINK).symlink_to(source.resolve(), target_is_directory=True)


def llava_configs(model_dir: str | Path) -> tuple[dict, dict, dict]:
    """(config.json, its vision_config, its text_config), the sub-configs with every field filled as
    transformers' config classes fill them (LlavaConfig's defaults for what is missing)."""
    root = Path(model_dir).expanduser().absolute()
    hf = read_hf_config(root)
    if hf.get("model_type") != "llava":
        raise ValueError(f"model_type {hf.get('model_type')!r} in {root}/config.json is not a LLaVA-1.5-style "
                         "model; the vision encoder reads model_type 'llava' (LlavaForConditionalGeneration)")
    vision = {"model_type": "clip_vision_model", **(hf.get("vision_config") or _LLAVA_DEFAULT_VISION)}
    if vision["model_type"] not in TOWERS:
        raise ValueError(f"{root}/config.json has vision_config.model_type {vision['model_type']!r}; the engine "
                         f"runs {' and '.join(TOWERS)} towers")
    text = hf_config({"model_type": "llama", **(hf.get("text_config") or {})})
    if text["model_type"] not in _TEXT_MODELS:
        raise ValueError(f"{root}/config.json has text_config.model_type {text['model_type']!r}; the engine runs "
                         f"LLaVA over {', '.join(_TEXT_MODELS)} decoders")
    return hf, _filled(vision), _filled(text)


def _filled(sub_config: dict) -> dict:
    from transformers import AutoConfig  # heavy: model_sources (imported by replicas) imports this module

    kwargs = {k: v for k, v in sub_config.items() if k not in ("architectures", "transformers_version")}
    return AutoConfig.for_model(**kwargs).to_dict()


def language_model_files(model_dir: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(the decoder's config.json dict, its state dict) as a plain causal LM's checkpoint would hold them.

    The config is text_config with every field filled as transformers fills it, `architectures` the
    causal-LM class and `torch_dtype` the checkpoint's. The state dict is named "model.embed_tokens.weight",
    "model.layers.0.…", "model.norm.weight", "lm_head.weight"; with tie_word_embeddings, lm_head.weight
    is the embedding matrix itself (transformers ties them whatever the file holds).
    """
    root = Path(model_dir).expanduser().absolute()
    hf, _, text = llava_configs(root)
    layout = Layout.of(root)
    state = read_tensors(root, lambda key: key.startswith(layout.language) or key == layout.lm_head)
    state = {("lm_head.weight" if key == layout.lm_head else "model." + key.removeprefix(layout.language)): value
             for key, value in state.items()}
    if "model.embed_tokens.weight" not in state:
        raise ValueError(f"{root} has no {layout.language}embed_tokens.weight: not a LLaVA checkpoint's decoder")
    if text.get("tie_word_embeddings"):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    elif "lm_head.weight" not in state:
        raise ValueError(f"{root} has no {layout.lm_head} and its text_config does not tie it to the embeddings")
    declared = hf.get("torch_dtype") or hf.get("dtype") or text.get("torch_dtype") or text.get("dtype") or "float32"
    text.pop("dtype", None)
    text.update(architectures=[_TEXT_MODELS[text["model_type"]]], torch_dtype=str(declared).removeprefix("torch."))
    return text, state


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a LlavaForConditionalGeneration checkpoint keeps its parts: the key prefixes."""

    vision: str
    """Of the tower's `vision_model` (embeddings, pre_layrnorm, encoder, ...)."""
    projector: str
    language: str
    """Of the decoder's base model (embed_tokens, layers, norm)."""
    lm_head: str
    """The LM head's weight's full key."""

    @staticmethod
    def of(root: Path) -> Layout:
        keys = _tensor_names(root)
        if any(k.startswith("model.vision_tower.") for k in keys):  # transformers >= 4.52's names
            return Layout("model.vision_tower.vision_model.", "model.multi_modal_projector.",
                          "model.language_model.", "lm_head.weight")
        if any(k.startswith("vision_tower.") for k in keys):  # earlier ones (llava-hf/llava-1.5-7b-hf)
            return Layout("vision_tower.vision_model.", "multi_modal_projector.", "language_model.model.",
                          "language_model.lm_head.weight")
        raise ValueError(f"{root} has no vision_tower weights (model.vision_tower.* or vision_tower.*): not a "
                         "LlavaForConditionalGeneration checkpoint")


def read_tensors(root: Path, keep: Callable[[str], bool]) -> dict[str, np.ndarray]:
    """The tensors whose key `keep` accepts, read from the shards that hold them (nothing else is read)."""
    state: dict[str, np.ndarray] = {}
    for file in _weight_files(root):
        with safe_open(str(file), framework="np") as f:
            state.update((key, f.get_tensor(key)) for key in filter(keep, f.keys()))
    return state


def _weight_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return sorted({root / name for name in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root} has no *.safetensors weights; the engine reads safetensors only (convert "
                         "pytorch_model.bin with transformers: from_pretrained, then save_pretrained)")
    return files


def _tensor_names(root: Path) -> set[str]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for file in _weight_files(root):
        with safe_open(str(file), framework="np") as f:
            names.update(f.keys())
    return names
