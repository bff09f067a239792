"""What a checkpoint's `quantization_config` (config.json) says about its weights.

Supported: FP8 weights (float8 e4m3) with float32 scales that multiply them, as two formats ship them:
- `quant_method: fp8` (DeepSeek-V3/R1, Qwen's `-FP8` releases): one scale per block of
  `weight_block_size` = [output rows, input columns] (default [128, 128]), `<linear>.weight_scale_inv`
  of shape [ceil(out / rows), ceil(in / columns)]; every linear layer but the LM head and
  `modules_to_not_convert` is FP8 (transformers' rule: a module is left out if one of the names is
  part of its own).
- `quant_method: compressed-tensors`, format `float-quantized` (the "FP8" and "FP8-dynamic"
  releases): `<linear>.weight_scale` per tensor ([1]), per output channel ([out, 1]) or per block
  (`block_structure`); every `Linear` but those `ignore` names (exactly, or by `re:` pattern).
And MXFP4 experts (`quant_method: mxfp4`, gpt-oss): 4-bit floats in blocks of 32 values with a
power-of-two scale each (engine.layers.mxfp4), for the experts not in `modules_to_not_convert`.
Activations stay in the served dtype: a checkpoint's activation scheme (dynamic per-token FP8, or
static `input_scale`s) is not applied; the products are the weights' (exactly dequantized) with
unquantized inputs, as transformers computes them from the dequantized weights.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

SUPPORTED = ("fp8 (block-wise, weight_scale_inv)",
             "compressed-tensors float-quantized 8-bit (tensor, channel or block weight_scale)",
             "mxfp4 (experts' _blocks and _scales)")


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """Low-bit weights, each with scales of `block` = (output rows, input columns) per scale (0: the
    whole dimension): FP8 (`fp8`, `compressed-tensors`) or MXFP4 experts (`mxfp4`)."""

    method: str
    """config.json's `quant_method`."""
    block: tuple[int, int]
    scale_name: str
    """The scales' tensor beside each FP8 `weight`: `weight_scale_inv` or `weight_scale` (MXFP4: `scales`
    beside `blocks`)."""
    skipped: tuple[str, ...] = ()
    """Modules left in float: names (as the method matches them) or `re:` patterns."""

    def quantizes(self, module: str) -> bool:
        """Whether the config says `module` (transformers' dotted name, e.g. `model.layers.0.mlp.up_proj`)
        is FP8. Loading goes by the checkpoint's own tensors; this decides for shapes alone."""
        if module.endswith("lm_head") or module == "lm_head":
            return False
        if self.method in ("fp8", "mxfp4"):
            return not any(name in module for name in self.skipped)
        return not any(re.match(name[3:], module) if name.startswith("re:") else name == module
                       for name in self.skipped)


def read_quantization(hf: dict) -> Optional[CheckpointQuantization]:
    """The quantization of a checkpoint's config.json (as read_hf_config reads it); None for float
    weights. ValueError, naming what is supported, for any other method or layout."""
    config = hf.get("quantization_config")
    if not config:
        return None
    method = config.get("quant_method")
    if method == "fp8":
        return _fp8(config)
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "mxfp4":
        return CheckpointQuantization("mxfp4", (1, 32), "scales", tuple(config.get("modules_to_not_convert") or ()))
    raise ValueError(f"quantization_config.quant_method {method!r} is not supported; supported: {'; '.join(SUPPORTED)}")


def _fp8(config: dict) -> CheckpointQuantization:
    if config.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"fp8 format {config['fmt']!r} is not supported; supported: e4m3")
    block = config.get("weight_block_size") or (128, 128)
    if len(block) != 2 or min(block) <= 0:
        raise ValueError(f"fp8 weight_block_size {block!r} is not [output rows, input columns]")
    return CheckpointQuantization("fp8", (int(block[0]), int(block[1])), "weight_scale_inv",
                                  tuple(config.get("modules_to_not_convert") or ()))


def _compressed_tensors(config: dict) -> CheckpointQuantization:
    layout = config.get("format")
    groups = list((config.get("config_groups") or {}).values())
    if layout != "float-quantized" or len(groups) != 1:
        raise ValueError(f"compressed-tensors format {layout!r} with {len(groups)} config groups is not supported; "
                         f"supported: {SUPPORTED[1]} in one config group")
    group = groups[0]
    weights, targets = group.get("weights") or {}, group.get("targets") or []
    if (weights.get("num_bits"), weights.get("type")) != (8, "float") or not weights.get("symmetric", True):
        raise ValueError(f"compressed-tensors weights of {weights.get('num_bits')} bits, type "
                         f"{weights.get('type')!r} are not supported; supported: {SUPPORTED[1]}")
    if targets != ["Linear"]:
        raise ValueError(f"compressed-tensors targets {targets!r} are not supported; supported: ['Linear']")
    strategy = weights.get("strategy")
    if strategy == "tensor":
        block = (0, 0)
    elif strategy == "channel":
        block = (1, 0)
    elif strategy == "block" and len(weights.get("block_structure") or ()) == 2:
        block = tuple(int(b) for b in weights["block_structure"])
    else:
        raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported; "
                         "supported: tensor, channel, block (with block_structure)")
    return CheckpointQuantization("compressed-tensors", block, "weight_scale", tuple(config.get("ignore") or ()))
