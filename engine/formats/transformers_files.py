"""What transformers 4 and 5 write into a checkpoint directory, read the same way: config.json and
the tokenizer. Pure Python (transformers' tokenizers, no jax).

transformers 5 changed two things the pinned transformers 4 and levanter do not read:
- RoPE settings live under `rope_parameters` (`rope_theta`, `rope_type` and the type's fields)
  instead of `rope_theta` and `rope_scaling`. Read as transformers 4 reads it, such a model would run
  with the default theta and no scaling, and answer garbage without an error; `hf_config` moves them
  back.
- The tokenizer's class is `TokenizersBackend` (one class over a tokenizers-library tokenizer.json),
  which transformers 4 does not know; `load_tokenizer` reads the same files as a fast tokenizer.
A RoPE type the engine does not implement is an error that names it, never a silent default.
"""

from __future__ import annotations

import json
from pathlib import Path

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
"""The RoPE scalings the engine runs (levanter's)."""

TRANSFORMERS5_TOKENIZERS = ("TokenizersBackend",)

_TOKENIZER_FIELDS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
                     "additional_special_tokens", "extra_special_tokens", "model_max_length", "padding_side",
                     "truncation_side", "clean_up_tokenization_spaces")


def hf_config(config: dict) -> dict:
    """config.json as transformers 4 and levanter read it, whichever transformers wrote it.
    ValueError naming what the engine cannot run (an unknown RoPE type)."""
    config = dict(config)
    if isinstance(config.get("rope_parameters"), dict):
        rope = dict(config.pop("rope_parameters"))
        if "rope_theta" not in rope and all(isinstance(v, dict) for v in rope.values()):
            rope = _rope_per_layer_type(config, rope)
        if "rope_theta" in rope:
            config["rope_theta"] = rope.pop("rope_theta")
        if "partial_rotary_factor" in rope:
            config["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
        kind = rope.get("rope_type", rope.get("type", "default"))
        config["rope_scaling"] = None if kind == "default" and not rope.keys() - {"rope_type", "type"} else rope
    scaling = config.get("rope_scaling")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"config.json asks for RoPE type {kind!r}, which the engine does not implement; "
                         f"supported: {', '.join(ROPE_TYPES)}")
    return config


def _rope_per_layer_type(config: dict, rope: dict) -> dict:
    """transformers 5's RoPE per layer type (Gemma 3): the full layers' is the model's; the sliding
    layers' is Gemma 3's `rope_local_base_freq`, which the engine runs unscaled only."""
    sliding = rope.get("sliding_attention", {})
    if set(rope) - {"full_attention", "sliding_attention"} or "full_attention" not in rope or (
            sliding and sliding.get("rope_type", "default") != "default"):
        raise ValueError(f"config.json sets RoPE per layer type ({json.dumps(rope)}); the engine runs one RoPE for "
                         "full-attention layers and an unscaled one (Gemma 3's local) for sliding layers")
    if "rope_theta" in sliding:
        config["rope_local_base_freq"] = sliding["rope_theta"]
    return dict(rope["full_attention"])


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's Hugging Face tokenizer, as transformers 4 loads it; a transformers 5
    `TokenizersBackend` tokenizer read from its tokenizer.json with the special tokens and chat
    template saved beside it."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # heavy; `hf_config` readers need none

    path = Path(model_dir).expanduser().absolute()
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if config.get("tokenizer_class") not in TRANSFORMERS5_TOKENIZERS:
        return _with_processor_template(AutoTokenizer.from_pretrained(str(path)), path)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"{path} has a {config['tokenizer_class']} tokenizer (transformers 5) but no tokenizer.json")
    kwargs = {field: config[field] for field in _TOKENIZER_FIELDS if config.get(field) is not None}
    if isinstance(kwargs.get("extra_special_tokens"), list):  # transformers 5's name for a list of them
        kwargs["additional_special_tokens"] = kwargs.pop("extra_special_tokens")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), **kwargs)
    template = path / "chat_template.jinja"
    tokenizer.chat_template = template.read_text() if template.is_file() else config.get("chat_template")
    return _with_processor_template(tokenizer, path)


def _with_processor_template(tokenizer, path: Path):
    """`tokenizer`, given the processor's chat template (chat_template.json, where multimodal
    checkpoints such as llava-hf keep it) when it has none of its own."""
    processor = path / "chat_template.json"
    if not tokenizer.chat_template and processor.is_file():
        tokenizer.chat_template = json.loads(processor.read_text()).get("chat_template")
    return tokenizer
