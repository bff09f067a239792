"""Convert a llama-architecture GGUF file into a Hugging Face checkpoint directory.

A GGUF file holds a whole model: hyperparameters and the tokenizer as metadata, weights as (often
quantised) tensors. `convert_gguf_to_hf` writes the directory that transformers and levanter load:

    config.json              LlamaForCausalLM hyperparameters from the `llama.*` metadata
    generation_config.json   bos / eos / pad ids from the `tokenizer.ggml.*` metadata
    model.safetensors        dequantised weights under HF names, Q/K rows un-permuted
    tokenizer.json           byte-level BPE built from `tokenizer.ggml.tokens` / `merges`
    tokenizer_config.json    special tokens and `tokenizer.chat_template`

Pure numpy / gguf / safetensors / tokenizers: this module imports neither jax nor torch.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import gguf
import ml_dtypes  # numpy's bfloat16 (ml_dtypes is a jax dependency, not jax)
import numpy as np
from safetensors.numpy import save_file
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)

logger = logging.getLogger(__name__)

# GGUF tensor names -> Hugging Face Llama names. Per-layer names live under `blk.{i}.`.
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# llama.cpp token types (gguf.TokenType): which vocabulary entries become added tokens.
_SPECIAL_TYPES = {gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN}
_ADDED_TYPES = _SPECIAL_TYPES | {gguf.TokenType.USER_DEFINED}

# Llama 3's split pattern (its tokenizer.json; llama.cpp's "llama-bpe"). Qwen2 splits digits singly.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = _LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")

SUPPORTED_PRE_TOKENIZERS = ("gpt2", "smollm", "starcoder", "llama-bpe", "qwen2")


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Write a Hugging Face Llama checkpoint for the GGUF file `gguf_path` into `out_dir`.

    `dtype` ("float32" or "bfloat16") is the dtype of the dequantised weights. Returns `out_dir`.
    Raises ValueError for GGUF files this converter cannot represent faithfully (not llama, not a
    byte-level BPE tokenizer, extra tensors such as llama3 `rope_freqs`).
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    start = time.perf_counter()
    reader = gguf.GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    config = hf_config(meta)
    weights = hf_weights(reader, config["num_attention_heads"], config["num_key_value_heads"])
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    config["vocab_size"] = int(weights["model.embed_tokens.weight"].shape[0])
    config["torch_dtype"] = dtype
    _write_weights(weights, out / "model.safetensors", dtype)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config(meta))

    build_tokenizer(meta).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(meta))
    logger.info("converted %s to %s in %.1f s", gguf_path, out, time.perf_counter() - start)
    return out


# ---- metadata ---------------------------------------------------------------------------------


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The file's key/value metadata as Python values (arrays as lists), without `GGUF.*` keys."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ValueError(f"GGUF metadata lacks {key!r}; is this a complete llama model file?")
    return meta[key]


def _per_model(value: Any, key: str) -> int:
    """A hyperparameter that GGUF may store per layer; this converter needs one value for all."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(
                f"{key} varies across layers ({sorted(set(value))}); LlamaForCausalLM cannot express that"
            )
        value = value[0]
    return int(value)


def _f32(value: float) -> float:
    """A float32 metadata value as its shortest decimal (9.999999747e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def hf_config(meta: dict[str, Any]) -> dict[str, Any]:
    """config.json for LlamaForCausalLM from `llama.*` metadata (vocab and tying come from tensors)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture is {arch!r}; this converter handles 'llama' models only")
    hidden = int(_require(meta, "llama.embedding_length"))
    heads = _per_model(_require(meta, "llama.attention.head_count"), "llama.attention.head_count")
    kv_key = "llama.attention.head_count_kv"
    kv_heads = _per_model(meta.get(kv_key, heads), kv_key)
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary embeddings (rope dim {rope_dim} < head dim {head_dim}) don't convert")
    ids = _special_ids(meta)
    ffn_key = "llama.feed_forward_length"
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _per_model(_require(meta, ffn_key), ffn_key),
        "num_hidden_layers": int(_require(meta, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(_require(meta, "llama.context_length")),
        "rms_norm_eps": _f32(_require(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": ids["bos"],
        "eos_token_id": _eos_ids(meta),
        "pad_token_id": ids["pad"],
    }


def _rope_scaling(meta: dict[str, Any]) -> dict[str, Any] | None:
    kind = meta.get("llama.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(_require(meta, "llama.rope.scaling.factor"))}
    raise ValueError(f"rope scaling {kind!r} is not supported; only 'linear' or none convert")


def _special_ids(meta: dict[str, Any]) -> dict[str, int | None]:
    """bos / eos / unk / pad ids as the GGUF declares them (None where absent)."""
    keys = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}
    return {name: _opt_int(meta.get(f"tokenizer.ggml.{key}_token_id")) for name, key in keys.items()}


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _eos_ids(meta: dict[str, Any]) -> int | list[int] | None:
    """The ids that end generation: eos, then end-of-turn / end-of-message ids if the GGUF has them."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _opt_int(meta.get(f"tokenizer.ggml.{key}"))
        if value is not None and value not in ids:
            ids.append(value)
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: which ids start, pad and end a sequence."""
    ids = _special_ids(meta)
    return {"bos_token_id": ids["bos"], "eos_token_id": _eos_ids(meta), "pad_token_id": ids["pad"]}


# ---- weights ----------------------------------------------------------------------------------


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face Llama name of a GGUF tensor; ValueError for tensors Llama has no place for."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if suffix == "weight" and base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.weight"
    if suffix == "weight" and len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}.weight"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no LlamaForCausalLM counterpart; only plain llama models "
        "(no biases, no llama3 rope_freqs, no experts) convert"
    )


def dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    """A GGUF tensor as float32 in numpy (row-major, HF) layout: GGUF's shape reversed."""
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K projection rows (as transformers' GGUF loader does).

    HF Llama keeps each head's rotary rows as two halves [x_0..x_{d/2-1}, x_{d/2}..x_{d-1}]
    (rotate_half); llama.cpp interleaves them as pairs (x_0, x_{d/2}), (x_1, x_{d/2+1}), ...
    `n_head` is the number of heads the rows belong to: attention heads for Q, KV heads for K.
    """
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_weights(reader: gguf.GGUFReader, n_head: int, n_kv_head: int) -> dict[str, np.ndarray]:
    """All tensors dequantised to float32 under HF names, with Q/K rows in HF order."""
    weights = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        value = dequantize(tensor)
        if name.endswith("self_attn.q_proj.weight"):
            value = unpermute_qk(value, n_head)
        elif name.endswith("self_attn.k_proj.weight"):
            value = unpermute_qk(value, n_kv_head)
        weights[name] = value
    if "model.embed_tokens.weight" not in weights:
        raise ValueError("GGUF file has no token_embd.weight tensor; it is not a complete model")
    return weights


def _write_weights(weights: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    if dtype == "bfloat16":
        weights = {name: value.astype(ml_dtypes.bfloat16) for name, value in weights.items()}
    save_file(weights, str(path), metadata={"format": "pt"})


# ---- tokenizer --------------------------------------------------------------------------------


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The `tokenizers` equivalent of llama.cpp's regex splits for `tokenizer.ggml.pre`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "gpt2":
        return byte_level
    if pre in ("smollm", "starcoder"):
        # llama.cpp splits "\p{N}" then by GPT-2's pattern: Digits + ByteLevel, as StarCoder-style HF
        # tokenizer.json files (SmolLM2's included) spell it.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "qwen2"):
        pattern = _LLAMA3_PATTERN if pre == "llama-bpe" else _QWEN2_PATTERN
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
        bytes_only = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, bytes_only])
    raise ValueError(
        f"tokenizer.ggml.pre {pre!r} is not supported; known: {', '.join(SUPPORTED_PRE_TOKENIZERS)}. "
        "Add its split regex (see llama.cpp's llama-vocab.cpp) to engine/formats/gguf.py"
    )


def _merge_pair(merge: str) -> tuple[str, str]:
    # Byte-level BPE tokens never contain a literal space (it maps to 'Ġ'), so one space separates.
    left, sep, right = merge.partition(" ")
    if not sep or " " in right:
        raise ValueError(f"malformed BPE merge {merge!r} in tokenizer.ggml.merges")
    return left, right


def _token_types(meta: dict[str, Any], n_tokens: int) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type") or [int(gguf.TokenType.NORMAL)] * n_tokens
    if len(types) != n_tokens:
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {n_tokens} tokens")
    return [int(t) for t in types]


def _vocab(tokens: list[str]) -> dict[str, int]:
    """Token string -> id. Invariant: each string maps to its first id, as llama.cpp looks it up."""
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    if len(vocab) != len(tokens):
        repeats = len(tokens) - len(vocab)
        logger.warning("GGUF vocabulary repeats %d token strings; later copies are unreachable", repeats)
    return vocab


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """A `tokenizers` byte-level BPE tokenizer equivalent to llama.cpp's for this GGUF.

    Ids equal the GGUF token ids. CONTROL tokens become special added tokens (matched in text, skipped
    by `decode(skip_special_tokens=True)`); BOS/EOS are added only if `add_bos_token`/`add_eos_token`.
    """
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"tokenizer.ggml.model is {model!r}; only 'gpt2' (byte-level BPE) converts")
    tokens = [str(t) for t in _require(meta, "tokenizer.ggml.tokens")]
    merges = [_merge_pair(str(m)) for m in _require(meta, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab=_vocab(tokens), merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "gpt2")))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(meta, tokens)

    types = _token_types(meta, len(tokens))
    added = [
        AddedToken(tokens[i], special=t in _SPECIAL_TYPES, normalized=False)
        for i, t in enumerate(types)
        if t in _ADDED_TYPES
    ]
    tok.add_tokens(added)
    return tok


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> processors.PostProcessor:
    """ByteLevel (nothing added) unless the GGUF asks for BOS and/or EOS around every sequence."""
    ids = _special_ids(meta)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if not add_bos and not add_eos:
        return processors.ByteLevel(trim_offsets=False)
    bos = [tokens[_checked(ids["bos"], "bos")]] if add_bos else []
    eos = [tokens[_checked(ids["eos"], "eos")]] if add_eos else []
    single = [*bos, "$A:0", *eos]
    pair = single + [f"{t}:1" for t in bos] + ["$B:1"] + [f"{t}:1" for t in eos]
    special = sorted({(tokens[ids[n]], ids[n]) for n, on in (("bos", add_bos), ("eos", add_eos)) if on})
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _checked(token_id: int | None, name: str) -> int:
    if token_id is None:
        raise ValueError(f"GGUF sets add_{name}_token but has no tokenizer.ggml.{name}_token_id")
    return token_id


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: special token strings, BOS/EOS switches, chat template, max length."""
    tokens = _require(meta, "tokenizer.ggml.tokens")
    ids = _special_ids(meta)
    types = _token_types(meta, len(tokens))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length", 2048)),
        "added_tokens_decoder": {
            str(i): {
                "content": tokens[i],
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": t in _SPECIAL_TYPES,
            }
            for i, t in enumerate(types)
            if t in _ADDED_TYPES
        },
    }
    for name, token_id in ids.items():
        config[f"{name}_token"] = None if token_id is None else tokens[token_id]
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
