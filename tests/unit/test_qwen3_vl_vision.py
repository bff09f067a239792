"""engine.models.qwen3_vl_vision against transformers 4.57's `Qwen3VLForConditionalGeneration.model.visual`.

A tiny random checkpoint (tests.support.qwen3_vl_models: depth 3, hidden 32, 4 heads of 8, a 4 x 4
position table, deepstack after blocks 0 and 2) written by save_pretrained; float32 on CPU, eager
attention in transformers. Measured: at most 7.5e-8 on outputs of order 0.5 (a misplaced rotary axis
or attention across images moves them by ~3e-2); 1e-5 is asserted.
"""

from __future__ import annotations

import json
import shutil

import equinox as eqx
import numpy as np
import pytest
import torch
from PIL import Image

from engine.formats.safetensors_files import read_checkpoint
from engine.models.qwen3_vl_vision import (
    encode_images,
    load_qwen3_vision,
    read_qwen3_vision_config,
    vision_layout,
)
from serve_app.media.qwen_vl_images import QwenVLImageProcessor, image_tokens
from tests.support.qwen3_vl_models import TINY_VISION, make_qwen3_vl_checkpoint

TOLERANCE = 1e-5
GRIDS = [(1, 6, 8), (1, 4, 4), (1, 10, 2)]
"""Three images: larger than the 4 x 4 position table, equal to it, and a narrow strip."""
run = eqx.filter_jit(encode_images)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen3_vl_checkpoint(tmp_path_factory.mktemp("qwen3-vl"))


@pytest.fixture(scope="module")
def tower(checkpoint):
    return load_qwen3_vision(checkpoint[0])


def _patches(grids, seed: int = 0) -> np.ndarray:
    rows = sum(t * h * w for t, h, w in grids)
    return np.random.default_rng(seed).normal(size=(rows, 3 * 2 * 4 * 4)).astype(np.float32)


def _reference(model, patches: np.ndarray, grids):
    with torch.no_grad():
        merged, deepstack = model.model.visual(torch.from_numpy(patches), grid_thw=torch.tensor(grids))
    return merged.numpy(), [d.numpy() for d in deepstack]


def _max_difference(ours, reference) -> float:
    merged, deepstack = ours
    assert len(deepstack) == len(reference[1])
    pairs = [(merged, reference[0]), *zip(deepstack, reference[1])]
    for a, b in pairs:
        assert np.asarray(a).shape == b.shape
    return max(float(np.abs(np.asarray(a) - b).max()) for a, b in pairs)


def test_checkpoint_keeps_the_tower_under_model_visual(checkpoint):
    keys = set(read_checkpoint(checkpoint[0]))
    assert {"model.visual.patch_embed.proj.weight", "model.visual.pos_embed.weight",
            "model.visual.blocks.2.attn.qkv.weight", "model.visual.merger.linear_fc2.bias",
            "model.visual.deepstack_merger_list.1.norm.weight"} <= keys


def test_images_in_one_call_equal_transformers(checkpoint, tower):
    patches = _patches(GRIDS)
    ours = run(tower, patches, GRIDS)
    reference = _reference(checkpoint[1], patches, GRIDS)
    assert np.asarray(ours[0]).shape == (sum(image_tokens(g, 2) for g in GRIDS), 48)
    assert len(ours[1]) == len(TINY_VISION["deepstack_visual_indexes"])
    assert _max_difference(ours, reference) <= TOLERANCE


def test_an_image_does_not_attend_to_its_neighbours(tower):
    patches = _patches(GRIDS)
    together = run(tower, patches, GRIDS)
    first = 6 * 8
    alone = run(tower, patches[first: first + 16], GRIDS[1:2])
    tokens = slice(first // 4, (first + 16) // 4)
    np.testing.assert_allclose(np.asarray(together[0])[tokens], np.asarray(alone[0]), atol=1e-6)
    for a, b in zip(together[1], alone[1]):
        np.testing.assert_allclose(np.asarray(a)[tokens], np.asarray(b), atol=1e-6)


def test_processed_image_through_the_tower_equals_transformers(checkpoint, tower):
    """The whole image path: this processor's patches equal the slow processor's, so the tower's
    input is transformers' own."""
    from transformers import Qwen2VLImageProcessor

    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (37, 53, 3), dtype=np.uint8))
    config = json.loads((checkpoint[0] / "preprocessor_config.json").read_text())
    patches, grid = QwenVLImageProcessor.from_dir(checkpoint[0])(image)
    expected = Qwen2VLImageProcessor(patch_size=4, image_mean=[0.5] * 3, image_std=[0.5] * 3).preprocess(
        image, size=config["size"], return_tensors="np")
    np.testing.assert_array_equal(patches, expected["pixel_values"])
    assert [list(grid)] == expected["image_grid_thw"].tolist()
    ours = run(tower, patches, [grid])
    assert _max_difference(ours, _reference(checkpoint[1], patches, [grid])) <= TOLERANCE


def test_layout_orders_patches_by_merge_block(tower):
    layout = vision_layout(tower.config, [(1, 2, 4), (1, 2, 2)])
    assert layout.rows.tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1]
    assert layout.cols.tolist() == [0, 1, 0, 1, 2, 3, 2, 3, 0, 1, 0, 1]
    assert layout.segments.tolist() == [0] * 8 + [1] * 4
    np.testing.assert_allclose(layout.weights.sum(axis=1), 1.0, atol=1e-6)


def test_grids_and_patches_that_disagree_are_refused(tower):
    with pytest.raises(ValueError, match="multiples of merge_size 2"):
        vision_layout(tower.config, [(1, 3, 4)])
    with pytest.raises(ValueError, match=r"expected \(16, 96\)"):
        encode_images(tower, _patches([(1, 2, 4)]), [(1, 4, 4)])


@pytest.mark.parametrize("change,message", [
    ({"num_heads": 16}, "divisible by 4"),
    ({"hidden_act": "relu6"}, "hidden_act 'relu6'"),
    ({"num_position_embeddings": 15}, "must be a square"),
    ({"deepstack_visual_indexes": [0, 3]}, r"distinct block indices in 0\.\.2"),
])
def test_bad_vision_configs_are_refused(checkpoint, tmp_path, change, message):
    shutil.copy(checkpoint[0] / "config.json", tmp_path / "config.json")
    config = json.loads((tmp_path / "config.json").read_text())
    config["vision_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        read_qwen3_vision_config(tmp_path)


def test_a_checkpoint_without_the_tower_is_refused(checkpoint, tmp_path):
    shutil.copy(checkpoint[0] / "config.json", tmp_path / "config.json")
    from safetensors.numpy import save_file

    save_file({"lm_head.weight": np.zeros((2, 2), np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="has no vision tower weights"):
        load_qwen3_vision(tmp_path)


def test_bfloat16_tower_stays_near_float32(checkpoint, tower):
    """bf16 weights and activations (LayerNorm, rotary and softmax in float32): within bf16's rounding
    of the float32 tower (measured 4e-3 on outputs of order 0.5)."""
    patches = _patches(GRIDS[:2])
    exact = run(tower, patches, GRIDS[:2])
    rounded = run(load_qwen3_vision(checkpoint[0], "bfloat16"), patches, GRIDS[:2])
    assert rounded[0].dtype == np.dtype("bfloat16")
    for a, b in zip((exact[0], *exact[1]), (rounded[0], *rounded[1])):
        np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a), atol=2e-2)
