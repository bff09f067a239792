"""Reading safetensors files ourselves, for the dtypes levanter's reader refuses: the 8-bit floats
of FP8 checkpoints (F8_E4M3, F8_E5M2), MXFP4's packed 4-bit blocks (U8) and their power-of-two
scales (F8_E8M0, kept as their byte, `E8M0`), beside the usual floats and integers.

The format: 8 bytes of little-endian header length, a JSON header naming each tensor's dtype, shape
and byte range, then the bytes. Tensors are memory-mapped numpy arrays of the file (no copy until
used); a sharded checkpoint's `model.safetensors.index.json` names the file of each tensor.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

E8M0 = np.dtype(np.uint8)
"""An F8_E8M0 scale is read as its byte: 2 ** (byte - 127) (engine.layers.quantize decodes it)."""

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": E8M0,
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def read_file(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file, memory-mapped; ValueError for a dtype it cannot hold."""
    path = Path(path)
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + length)
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {entry['dtype']}, which this reader does not know; "
                             f"it reads {', '.join(DTYPES)}")
        start, end = entry["data_offsets"]
        tensors[name] = data[start:end].view(DTYPES[entry["dtype"]]).reshape(entry["shape"])
    return tensors


def read_checkpoint(model_dir: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory: its single file, or every shard its index names."""
    model_dir = Path(model_dir)
    if (model_dir / INDEX).is_file():
        shards = dict.fromkeys(json.loads((model_dir / INDEX).read_text())["weight_map"].values())
        tensors: dict[str, np.ndarray] = {}
        for shard in shards:
            tensors.update(read_file(model_dir / shard))
        return tensors
    if (model_dir / SINGLE).is_file():
        return read_file(model_dir / SINGLE)
    raise ValueError(f"{model_dir} has no {SINGLE} nor {INDEX}")
