"""LoRA adapters as PEFT saves them: a directory with adapter_config.json and
adapter_model.safetensors. Pure Python and numpy (no jax).

`read_adapter` returns each adapted projection's two factors as the checkpoint stores them, with
PEFT's scale folded into B: a projection W (out x in) becomes W + B @ A, A (rank x in), B (out x
rank) times lora_alpha / rank (lora_alpha / sqrt(rank) with `use_rslora`; per-module ranks and
alphas from `rank_pattern` / `alpha_pattern`). Only what the engine can serve is accepted; anything
else (DoRA, trained biases, replaced modules, an unsupported projection, sizes that are not the
base model's) is a ValueError that says what the adapter asks for.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file

from engine.formats.checkpoint_config import ModelInfo

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may adapt (each layer's attention and MLP)."""

_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclasses.dataclass(frozen=True)
class LoraFactors:
    """One adapted projection of one layer: W + b @ a, the adapter's scale folded into b."""

    a: np.ndarray  # f32[rank, in]
    b: np.ndarray  # f32[out, rank]


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """An adapter read from disk: its factors by (layer, projection name)."""

    path: str
    rank: int
    """The largest rank of any of its projections."""
    factors: dict[tuple[int, str], LoraFactors]

    @property
    def targets(self) -> list[str]:
        return sorted({name for _, name in self.factors}, key=TARGETS.index)


def read_adapter(path: str | Path, info: ModelInfo, max_rank: int, targets: tuple[str, ...] = TARGETS) -> LoraAdapter:
    """The adapter at `path` for a model of `info`'s sizes; ValueError if the engine cannot serve
    it (a rank above `max_rank`, a projection outside `targets`, anything `_check_config` refuses)."""
    directory = Path(path).expanduser().absolute()
    config_file = directory / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"{directory} is not a PEFT LoRA adapter: it has no adapter_config.json")
    config = json.loads(config_file.read_text())
    _check_config(config, directory)
    weights = directory / "adapter_model.safetensors"
    if not weights.is_file():
        raise ValueError(f"{directory} has no adapter_model.safetensors (a PyTorch adapter_model.bin is not read: "
                         "save the adapter with safe_serialization=True)")
    tensors = _read_tensors(weights)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{directory}: weight {key!r} is not a LoRA factor of a layer's projection; the "
                             f"engine adapts {', '.join(TARGETS)}")
        layer, name, part = int(match.group(1)), match.group(3), match.group(4)
        if layer >= info.num_layers:
            raise ValueError(f"{directory} adapts layer {layer}; the model has {info.num_layers} layers")
        pairs.setdefault((layer, name), {})[part] = np.asarray(tensor, np.float32)
    if not pairs:
        raise ValueError(f"{directory}/adapter_model.safetensors holds no LoRA weights")
    order = lambda name: TARGETS.index(name) if name in TARGETS else len(TARGETS)  # noqa: E731
    refused = sorted({name for _, name in pairs if name not in targets}, key=order)
    if refused:
        raise ValueError(f"{directory} adapts {', '.join(refused)}, which this model's layers cannot take an adapter "
                         f"on; it can adapt {', '.join(targets)}")
    ordered = sorted(pairs.items(), key=lambda kv: (kv[0][0], order(kv[0][1])))
    factors = {key: _factors(key, pair, config, info, directory) for key, pair in ordered}
    rank = max(f.a.shape[0] for f in factors.values())
    if rank > max_rank:
        raise ValueError(f"{directory} has LoRA rank {rank}, above max_lora_rank={max_rank}; raise max_lora_rank")
    return LoraAdapter(str(directory), rank, factors)


def _check_config(config: dict, directory: Path) -> None:
    refuse = [
        (config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')!r} (only LORA is served)"),
        (bool(config.get("use_dora")), "DoRA (use_dora)"),
        (config.get("bias", "none") != "none", f"trained biases (bias={config.get('bias')!r})"),
        (bool(config.get("lora_bias")), "LoRA biases (lora_bias)"),
        (bool(config.get("modules_to_save")),
         f"whole replaced modules (modules_to_save={config.get('modules_to_save')})"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out weights"),
    ]
    asked = [what for bad, what in refuse if bad]
    if asked:
        raise ValueError(f"{directory}: the engine cannot serve an adapter with {'; '.join(asked)}")


def _factors(key: tuple[int, str], pair: dict[str, np.ndarray], config: dict, info: ModelInfo,
             directory: Path) -> LoraFactors:
    layer, name = key
    if set(pair) != {"A", "B"}:
        raise ValueError(f"{directory}: layer {layer} {name} has lora_{''.join(pair)} without its pair")
    a, b = pair["A"], pair["B"]
    size_in, size_out = _sizes(name, info)
    rank = a.shape[0]
    if a.shape != (rank, size_in) or b.shape != (size_out, rank):
        raise ValueError(f"{directory}: layer {layer} {name} has factors {a.shape} and {b.shape}; this model's "
                         f"{name} needs ({rank}, {size_in}) and ({size_out}, {rank}) (an adapter for another model?)")
    module = f"model.layers.{layer}.{'self_attn' if name in TARGETS[:4] else 'mlp'}.{name}"
    alpha = _pattern(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoraFactors(a, b * np.float32(scale))


def _pattern(patterns: dict, module: str, default):
    """PEFT's per-module override: the value of the first key that names `module` (its full name
    or a dotted suffix of it, as a regular expression), else `default`."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def _sizes(name: str, info: ModelInfo) -> tuple[int, int]:
    """(in, out) of a projection of `info`'s model."""
    hidden, q, kv = info.hidden_size, info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, info.intermediate_size), "up_proj": (hidden, info.intermediate_size),
            "down_proj": (info.intermediate_size, hidden)}[name]


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32 (ml_dtypes gives numpy bfloat16)."""
    floating = {np.dtype(t) for t in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16)}
    out = {}
    for key, tensor in load_file(str(path)).items():
        if tensor.dtype not in floating:
            raise ValueError(f"{path}: tensor {key!r} has dtype {tensor.dtype}; LoRA factors are floating point")
        out[key] = tensor.astype(np.float32)
    return out
