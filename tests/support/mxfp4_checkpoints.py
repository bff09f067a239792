"""MXFP4 checkpoints made from tiny float gpt-oss ones, as gpt-oss ships its experts (engine.layers
.mxfp4), and the float copy transformers reads them as: the experts' dequantized values in float32."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.support.fp8_checkpoints import rewritten

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def quantized(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks u8[..., in / 32, 16], scales u8[..., in / 32]) of rows [..., in]: each block of 32 scaled
    by the power of two that brings its largest |value| to 6 or under, each value the nearest e2m1
    code (the low nibble holds the even value)."""
    blocks = rows.astype(np.float32).reshape(*rows.shape[:-1], -1, 32)
    largest = np.abs(blocks).max(axis=-1)
    exponent = np.ceil(np.log2(np.maximum(largest, 1e-30) / 6.0)).astype(np.int32)
    scaled = blocks / np.exp2(exponent)[..., None]
    codes = np.abs(scaled[..., None] - E2M1).argmin(axis=-1).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.astype(np.uint8), (exponent + 127).astype(np.uint8)


def dequantized(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    values = E2M1[codes] * np.exp2(scales.astype(np.int32) - 127)[..., None]
    return values.reshape(*blocks.shape[:-2], -1).astype(np.float32)


def make_mxfp4_checkpoint(model_dir: Path, out: Path) -> tuple[Path, Path]:
    """(an MXFP4 copy of the float gpt-oss checkpoint `model_dir` at `out`, the float32 copy
    transformers reads it as at `out`-float): the experts' gate_up_proj [E, in, out] and down_proj
    as `_blocks` / `_scales` over their output rows, everything else as it is."""
    def convert(name: str, w: np.ndarray):
        if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            return {name: ("F32", w.astype(np.float32))}, w.astype(np.float32)
        blocks, scales = quantized(np.swapaxes(w, -1, -2))
        return ({f"{name}_blocks": ("U8", blocks), f"{name}_scales": ("U8", scales)},
                np.swapaxes(dequantized(blocks, scales), -1, -2))

    return rewritten(model_dir, out, convert, {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
