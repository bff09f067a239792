"""FP8 checkpoints made from tiny float ones, as the FP8 releases ship them (engine.formats
.checkpoint_quantization), and the float copy transformers reads them as: every weight times its
scales, in float32."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

FP8_MAX = 448.0
_DTYPES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float16): "F16",
           np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(np.uint8): "U8", np.dtype(np.int64): "I64"}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """A safetensors file of `tensors` (name -> (dtype name, array)), laid out as the format says."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dtype, array) in tensors.items():
        blob = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def quantized(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(float8 weight, float32 scales [ceil(out / rows), ceil(in / cols)]) of w [out, in]: each
    block's largest |w| maps to e4m3's largest value (a block of 0 rows or columns: the whole)."""
    out, cols = w.shape
    rows, width = block[0] or out, block[1] or cols
    scales = np.zeros((-(-out // rows), -(-cols // width)), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = w[i * rows:(i + 1) * rows, j * width:(j + 1) * width].astype(np.float32)
            scale = np.float32(max(np.abs(part).max(), 1e-12) / FP8_MAX)
            scales[i, j] = scale
            q[i * rows:(i + 1) * rows, j * width:(j + 1) * width] = (part / scale).astype(ml_dtypes.float8_e4m3fn)
    return q, scales


def dequantized(q: np.ndarray, scales: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    out, cols = q.shape
    rows, width = block[0] or out, block[1] or cols
    full = np.repeat(np.repeat(scales, rows, axis=0)[:out], width, axis=1)[:, :cols]
    return q.astype(np.float32) * full


def rewritten(model_dir: Path, out: Path, convert, quantization_config: dict) -> tuple[Path, Path]:
    """(a copy of `model_dir` at `out` whose tensors `convert(name, array)` rewrites and whose
    config.json carries `quantization_config`, the float32 copy transformers reads it as at
    `out`-float). `convert` returns (the tensors it becomes: name -> (dtype name, array), its float32
    value)."""
    from safetensors.numpy import load_file

    reference = Path(f"{out}-float")
    shutil.copytree(model_dir, out)
    shutil.copytree(model_dir, reference)
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors, floats = {}, {}
        for name, w in load_file(path).items():
            written, floats[name] = convert(name, w)
            tensors.update(written)
        write_safetensors(out / path.name, tensors)
        write_safetensors(reference / path.name, {name: ("F32", w) for name, w in floats.items()})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out, reference


def make_fp8_checkpoint(model_dir: Path, out: Path, *, method: str = "fp8", block: tuple[int, int] = (16, 32),
                        strategy: str = "block", routers: bool = False) -> tuple[Path, Path]:
    """(an FP8 copy of the float checkpoint `model_dir` at `out`, the float32 copy transformers
    reads it as at `out`-float). Every 2-D weight of a linear layer but the LM head (and routers,
    unless `routers`) is FP8. `method`: "fp8" (scales `weight_scale_inv` per `block`) or
    "compressed-tensors" (`weight_scale` per tensor, channel or block, as `strategy` says)."""
    if method == "compressed-tensors":
        block = {"tensor": (0, 0), "channel": (1, 0), "block": block}[strategy]
    scale_name = "weight_scale_inv" if method == "fp8" else "weight_scale"

    def convert(name: str, w: np.ndarray):
        linear = w.ndim == 2 and name.endswith(".weight") and "embed_tokens" not in name and "lm_head" not in name
        if not linear or (not routers and name.endswith("mlp.gate.weight")):
            return {name: (_DTYPES[w.dtype], w)}, w.astype(np.float32)
        q, scales = quantized(w, block)
        value = dequantized(q, scales, block)
        if method == "compressed-tensors" and strategy != "block":
            scales = scales.reshape(-1, 1) if strategy == "channel" else scales.reshape(1)
        return {name: ("F8_E4M3", q), f"{name.removesuffix('.weight')}.{scale_name}": ("F32", scales)}, value

    return rewritten(model_dir, out, convert, quantization_config(method, block, strategy))


def quantization_config(method: str, block: tuple[int, int], strategy: str) -> dict:
    if method == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "block_structure": list(block) if strategy == "block" else None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": {
                "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}}}}
