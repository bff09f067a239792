"""A decoder checkpoint's config.json (and generation_config.json), read: the sizes and EOS ids the
engine needs besides the weights (`ModelInfo`), and the dtype it declares. Pure Python (no jax, no
weights read): the loader (engine.models.loading), the LoRA reader (engine.formats.peft) and the
planners read the same facts here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Optional

from engine.formats.transformers_files import hf_config

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "mixtral", "gemma2", "gemma3_text",
                      "qwen3_moe", "phi3", "gpt_oss", "deepseek_v3")
"""config.json `model_type`s the decoder loader reads (engine.models.loading maps each to levanter's, or
assembles it: engine.models.decoder)."""


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about a loaded model besides its weights."""

    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    """The weights' dtype as config.json declares it (float32 when it does not)."""
    num_experts: int = 0
    """Routed experts of each mixture-of-experts layer (0: a dense model)."""
    expert_intermediate_size: int = 0
    """The MLP size of one expert."""
    expert_block: int = 1
    """Values of an expert's MLP that split over devices only together (MXFP4's blocks of 32)."""
    values_are_keys: bool = False
    """The cached vector is each token's key and its value too (latent attention): the KV pool
    stores one array of `head_dim` a token and layer, not two."""
    long_rope_from: Optional[int] = None
    """longrope (Phi-3): a sequence longer than this rotates with its long factors, all its tokens
    (engine.layers.rope; the scheduler recomputes one that grows past it). None: one RoPE."""


def read_hf_config(model_dir: str | Path) -> dict:
    """config.json as transformers 4 and levanter read it, whichever transformers wrote it
    (engine.formats.transformers_files)."""
    path = Path(model_dir).expanduser().absolute() / "config.json"
    if not path.is_file():
        raise ValueError(f"{path.parent} is not a Hugging Face checkpoint directory: it has no config.json")
    return hf_config(json.loads(path.read_text()))


def model_info(model_dir: str | Path) -> ModelInfo:
    """Read sizes and EOS ids from config.json / generation_config.json (no weights, no jax work)."""
    hf = read_hf_config(model_dir)
    family = hf.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"model_type {family!r} in {model_dir}/config.json is not supported; "
            f"supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    heads = hf["num_attention_heads"]
    kv_heads, head_dim = hf.get("num_key_value_heads") or heads, hf.get("head_dim") or hf["hidden_size"] // heads
    latent = family == "deepseek_v3"  # latent attention: one cached vector a token, the RoPE key and the latent
    if latent:
        kv_heads, head_dim = 1, hf["kv_lora_rank"] + hf["qk_rope_head_dim"]
    return ModelInfo(
        family=family,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        eos_token_ids=_eos_ids(Path(model_dir), hf),
        dtype=declared_dtype(hf),
        values_are_keys=latent,
        long_rope_from=_long_rope_from(hf),
        **_experts(hf),
    )


def _long_rope_from(hf: dict) -> Optional[int]:
    scaling = hf.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) != "longrope":
        return None
    return hf.get("original_max_position_embeddings") or hf["max_position_embeddings"]


def _experts(hf: dict) -> dict:
    """ModelInfo's expert fields: Mixtral's experts are `intermediate_size` wide, Qwen3-MoE's
    `moe_intermediate_size`."""
    count = hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts") or 0
    if not count:
        return {}
    width = hf.get("moe_intermediate_size") or hf["intermediate_size"]
    mxfp4 = (hf.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    return {"num_experts": count, "expert_intermediate_size": width, "expert_block": 32 if mxfp4 else 1}


def declared_dtype(hf: dict) -> str:
    """config.json's `torch_dtype` (`dtype` in newer transformers) as a dtype the engine serves:
    float16 is served as bfloat16 (same bytes, float32's range), anything else as float32."""
    declared = str(hf.get("torch_dtype") or hf.get("dtype") or "float32").removeprefix("torch.")
    return "bfloat16" if declared in ("bfloat16", "float16") else "float32"


def generation_defaults(model_dir: str | Path, fields: Iterable[str]) -> dict[str, Any]:
    """Those of `fields` (sampling values: the serving layer's) that generation_config.json sets, not
    null, as written there; {} without the file. `do_sample` is not read, as vLLM does not read it: a
    checkpoint with do_sample false and a temperature samples at that temperature (greedy needs
    temperature 0 or top_k 1)."""
    path = Path(model_dir).expanduser().absolute() / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {name: config[name] for name in fields if config.get(name) is not None}


def _eos_ids(model_dir: Path, hf: dict) -> tuple[int, ...]:
    ids: list[int] = []
    generation = model_dir.expanduser().absolute() / "generation_config.json"
    for source in (hf, json.loads(generation.read_text()) if generation.is_file() else {}):
        eos = source.get("eos_token_id")
        for token in eos if isinstance(eos, list) else [eos]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return tuple(ids)
