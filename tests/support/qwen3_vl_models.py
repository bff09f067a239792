"""Tiny random Qwen3-VL checkpoints written by transformers, and Qwen's preprocessor_config.json.

`make_qwen3_vl_checkpoint` saves a `Qwen3VLForConditionalGeneration` (its weights perturbed by
N(0, 0.2), the mergers' matrices excepted: biases and norms far from 0 and 1, attention peaked enough
that a misplaced position shows, outputs of order 1) with a preprocessor_config.json in the shape Qwen ships
(`Qwen2VLImageProcessorFast`, `size: {shortest_edge, longest_edge}`) for the tiny tower's patch size.
"""

from __future__ import annotations

import json
from pathlib import Path

QWEN3_VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "processor_class": "Qwen3VLProcessor",
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "merge_size": 2, "patch_size": 16, "temporal_patch_size": 2, "resample": 3, "rescale_factor": 0.00392156862745098,
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
}
"""The fields of Qwen3-VL's published preprocessor_config.json."""

TINY_VISION = dict(depth=3, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=64, num_heads=4,
                   in_channels=3, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=48,
                   num_position_embeddings=16, deepstack_visual_indexes=[0, 2])
"""A tower small enough for CPU tests: head size 8, a 4 x 4 position table, deepstack after blocks 0 and 2."""

TINY_TEXT = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=12, rope_theta=10000.0,
                 rope_scaling={"rope_type": "default", "mrope_section": [2, 2, 2], "mrope_interleaved": True})


def make_qwen3_vl_checkpoint(out: Path, seed: int = 0, **vision) -> tuple[Path, object]:
    """A random Qwen3VLForConditionalGeneration saved (float32 safetensors) in `out`; (out, the torch model
    in eval mode, eager attention)."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen3VLConfig(vision_config={**TINY_VISION, **vision}, text_config=TINY_TEXT, image_token_id=120,
                           video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
    config._attn_implementation = "eager"
    model = Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.model.visual.named_parameters():
            if "merger" not in name or "norm" in name or "bias" in name:  # mergers' outputs stay near 1
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(out, safe_serialization=True)
    patch = config.vision_config.patch_size
    preprocessor = {**QWEN3_VL_PREPROCESSOR, "patch_size": patch,
                    "size": {"shortest_edge": (4 * patch) ** 2, "longest_edge": (16 * patch) ** 2}}
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    return out, model
