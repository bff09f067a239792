"""engine.formats.safetensors_files: our reader against the safetensors library on the dtypes both
know, and on the 8-bit floats and byte-valued scales only ours reads (written here by hand, in the
format's own layout), single files and sharded checkpoints."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from engine.formats.safetensors_files import E8M0, read_checkpoint, read_file
from tests.support.fp8_checkpoints import write_safetensors as write


def test_the_usual_dtypes_read_as_the_safetensors_library_reads_them(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"w": rng.standard_normal((3, 5)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float16),
               "i": np.arange(6, dtype=np.int64).reshape(2, 3), "m": np.array([True, False])}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    read = read_file(tmp_path / "model.safetensors")
    assert set(read) == set(tensors)
    for name, array in tensors.items():
        assert read[name].dtype == array.dtype and np.array_equal(read[name], array), name


def test_fp8_weights_and_byte_scales_read_as_their_values(tmp_path):
    """F8_E4M3 weights come back as ml_dtypes' float8_e4m3fn (the values written), BF16 as
    bfloat16, F8_E8M0 scales and MXFP4's U8 blocks as their bytes."""
    weight = np.array([[0.5, -1.75, 448.0], [0.0, 2.0, -0.015625]], ml_dtypes.float8_e4m3fn)
    bf16 = np.array([1.5, -3.0], ml_dtypes.bfloat16)
    scales = np.array([127, 130, 1], np.uint8)
    blocks = np.array([[0x1F, 0xA2]], np.uint8)
    write(tmp_path / "model.safetensors", {"w": ("F8_E4M3", weight), "n": ("BF16", bf16),
                                           "s": ("F8_E8M0", scales), "blocks": ("U8", blocks)})
    read = read_checkpoint(tmp_path)
    assert read["w"].dtype == ml_dtypes.float8_e4m3fn and read["w"].astype(np.float32).tolist() == [
        [0.5, -1.75, 448.0], [0.0, 2.0, -0.015625]]
    assert read["n"].dtype == ml_dtypes.bfloat16 and read["n"].astype(np.float32).tolist() == [1.5, -3.0]
    assert read["s"].dtype == E8M0 and read["s"].tolist() == [127, 130, 1]
    assert read["blocks"].tolist() == [[0x1F, 0xA2]]


def test_a_sharded_checkpoint_reads_every_shard_its_index_names(tmp_path):
    write(tmp_path / "a.safetensors", {"x": ("F32", np.ones(2, np.float32))})
    write(tmp_path / "b.safetensors", {"y": ("F8_E4M3", np.zeros(3, ml_dtypes.float8_e4m3fn))})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}))
    assert sorted(read_checkpoint(tmp_path)) == ["x", "y"]


def test_an_unknown_dtype_or_a_directory_without_weights_is_refused_by_name(tmp_path):
    write(tmp_path / "model.safetensors", {"x": ("F4", np.zeros(2, np.uint8))})
    with pytest.raises(ValueError, match="tensor x has dtype F4, which this reader does not know; it reads F64"):
        read_file(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="has no model.safetensors nor model.safetensors.index.json"):
        read_checkpoint(tmp_path / "missing")
