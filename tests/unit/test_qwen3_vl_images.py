"""serve_app.media.qwen_vl_images against transformers 4.57's slow Qwen2VLImageProcessor.

Qwen ships preprocessor_config.json naming Qwen2VLImageProcessorFast, which needs torchvision (not
installed here). The slow processor's `preprocess(size=...)` reads the size bounds as the Fast one
does, and its arithmetic is the one the module copies, so the patches must be bit-equal. The Fast
one's fused rescale + normalize is checked separately with torch (what it runs).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from serve_app.errors import BadRequest
from serve_app.media.qwen_vl_images import QwenVLImageProcessor, image_tokens, smart_resize
from tests.support.qwen3_vl_models import QWEN3_VL_PREPROCESSOR

QWEN25_STYLE = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2,
                "temporal_patch_size": 2, "min_pixels": 8 * 28 * 28, "max_pixels": 64 * 28 * 28}
"""CLIP mean/std by default, min_pixels/max_pixels instead of size, bounds small enough to scale down."""
SIZES = [(100, 100), (37, 211), (480, 640), (31, 33), (300, 1200), (5, 700), (1000, 997), (64, 64)]
"""(height, width): square, wide, tall, tiny (scaled up), large (scaled down), aspect ratio 140."""


def _image(height: int, width: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _reference(config: dict, image: Image.Image):
    """transformers' slow processor on `image`, with `config`'s bounds passed per call as Fast reads them."""
    from transformers import Qwen2VLImageProcessor

    fields = {k: v for k, v in config.items() if k not in ("image_processor_type", "processor_class", "size",
                                                             "min_pixels", "max_pixels")}
    processor = Qwen2VLImageProcessor(**fields)
    size = dict(config.get("size", {}))
    size.update({"shortest_edge": config["min_pixels"]} if "min_pixels" in config else {})
    size.update({"longest_edge": config["max_pixels"]} if "max_pixels" in config else {})
    out = processor.preprocess(image, size=size, return_tensors="np")
    return out["pixel_values"], tuple(int(x) for x in out["image_grid_thw"][0]), processor


@pytest.mark.parametrize("config", [QWEN3_VL_PREPROCESSOR, QWEN25_STYLE], ids=["qwen3_vl", "qwen25_style"])
@pytest.mark.parametrize("size", SIZES, ids=[f"{h}x{w}" for h, w in SIZES])
def test_patches_equal_transformers_bit_for_bit(config, size):
    image = _image(*size)
    patches, grid = QwenVLImageProcessor.from_config(config)(image)
    expected, expected_grid, processor = _reference(config, image)
    assert grid == expected_grid
    assert patches.dtype == np.float32 and expected.dtype == np.float32
    np.testing.assert_array_equal(patches, expected)
    ours = QwenVLImageProcessor.from_config(config)
    assert ours.image_tokens(*size) == image_tokens(grid, 2) == len(expected) // 4
    assert ours.grid(*size) == grid


def test_qwen3_config_reads_size_and_makes_multiples_of_32(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN3_VL_PREPROCESSOR))
    processor = QwenVLImageProcessor.from_dir(tmp_path)
    assert (processor.min_pixels, processor.max_pixels, processor.factor) == (65536, 16777216, 32)
    assert (processor.mean, processor.std) == ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    # 448 x 448 stays: 14 x 14 merged tokens; 100 x 100 grows to 256 x 256 (min_pixels): 8 x 8 tokens
    assert (processor.grid(448, 448), processor.image_tokens(448, 448)) == ((1, 28, 28), 196)
    assert (processor.grid(100, 100), processor.image_tokens(100, 100)) == ((1, 16, 16), 64)
    assert processor(_image(448, 448))[0].shape == (784, 3 * 2 * 16 * 16)


def test_min_and_max_pixels_override_size_as_fast_reads_them():
    config = {**QWEN3_VL_PREPROCESSOR, "max_pixels": 100 * 32 * 32}
    processor = QwenVLImageProcessor.from_config(config)
    assert (processor.min_pixels, processor.max_pixels) == (65536, 102400)
    assert processor.grid(1000, 1000) == (1, 20, 20)


@pytest.mark.parametrize("factor,bounds", [(28, (3136, 28 * 28 * 1280)), (32, (65536, 16777216)), (32, (1024, 40000))])
def test_smart_resize_equals_transformers(factor, bounds):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as reference

    rng = np.random.default_rng(1)
    for height, width in rng.integers(1, 3000, (400, 2)):
        if max(height, width) / min(height, width) > 200:
            continue
        assert smart_resize(int(height), int(width), factor, *bounds) == reference(int(height), int(width), factor,
                                                                                     *bounds)


def test_fast_processors_fused_normalize_is_within_float_rounding():
    """Qwen2VLImageProcessorFast computes (x - mean * 255) / (std * 255) in float32 (torch) where the
    slow one (and this module) computes (x / 255 - mean) / std: at most 2 float32 ulps of 1 apart."""
    processor = QwenVLImageProcessor.from_config(QWEN25_STYLE)
    values = np.broadcast_to(np.arange(256, dtype=np.uint8)[:, None, None], (256, 1, 3))
    ours = processor._normalized(np.ascontiguousarray(values))  # [3, 256, 1]
    mean, std = torch.tensor(processor.mean) * (1.0 / (1 / 255)), torch.tensor(processor.std) * (1.0 / (1 / 255))
    fast = (torch.from_numpy(np.ascontiguousarray(values)).permute(2, 0, 1).float() - mean[:, None, None]) \
        / std[:, None, None]
    difference = np.abs(fast.numpy() - ours).max()
    assert 0 < difference <= 2.5e-7


def test_rgba_and_grey_images_are_converted_to_rgb():
    processor = QwenVLImageProcessor.from_config(QWEN3_VL_PREPROCESSOR)
    rgb = _image(64, 96)
    rgba = rgb.convert("RGBA")
    np.testing.assert_array_equal(processor(rgba)[0], processor(rgb)[0])
    assert processor(rgb.convert("L"))[1] == processor(rgb)[1]


def test_extreme_aspect_ratio_is_a_bad_request():
    processor = QwenVLImageProcessor.from_config(QWEN3_VL_PREPROCESSOR)
    with pytest.raises(BadRequest, match="aspect ratio is over 200") as error:
        processor(_image(2, 500))
    assert error.value.param == "messages"


@pytest.mark.parametrize("change,message", [
    ({"image_processor_type": "CLIPImageProcessor"}, "processed by Qwen2VLImageProcessor"),
    ({"size": {"shortest_edge": 65536}}, "needs both 'shortest_edge'"),
    ({"size": {"shortest_edge": 2000, "longest_edge": 1000}}, "0 < min <= max"),
    ({"size": 448}, "a Qwen-VL processor takes"),
    ({"do_resize": False}, "set do_resize to true"),
    ({"patch_size": 0}, "patch_size 0; it must be a positive integer"),
    ({"image_mean": [0.5, 0.5]}, "give one number or three"),
])
def test_bad_configs_are_refused_saying_what_to_change(change, message):
    with pytest.raises(ValueError, match=message):
        QwenVLImageProcessor.from_config({**QWEN3_VL_PREPROCESSOR, **change})


def test_missing_preprocessor_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has no preprocessor_config.json"):
        QwenVLImageProcessor.from_dir(tmp_path)
