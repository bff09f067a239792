"""Qwen3-VL's vision tower in haliax + equinox: flattened image patches to the decoder's image features.

Reads a `Qwen3VLForConditionalGeneration` checkpoint: config.json's `vision_config` and the
`model.visual.*` safetensors weights. The forward pass is transformers' `Qwen3VLVisionModel`:
  * patch embedding: its Conv3d (stride = kernel) as one linear map of each flattened patch
    (channel, frame, pixel_row, pixel_col), with a bias;
  * plus learned position embeddings on a side x side grid, bilinearly interpolated to each image's
    patch grid (`fast_pos_embed_interpolate`: `linspace(0, side - 1, n)` sample points in float32,
    the four corner rows weighted and summed);
  * `depth` pre-norm blocks (LayerNorm eps 1e-6; attention with 2D rotary embeddings: the first
    half of each head's rotary angles from the patch's row, the second from its column; an MLP with
    `hidden_act`); attention never crosses from one image (or video frame) to another;
  * the merger: LayerNorm, each merge_size^2 block of consecutive patches concatenated, linear,
    GELU (erf), linear to `out_hidden_size`; and after each block listed in
    `deepstack_visual_indexes`, a deepstack merger (the same with the LayerNorm after the
    concatenation) whose output the decoder adds to its first layers' hidden states.

Patch order is the image processor's (serve_app.media.qwen_vl_images): per image, row-major over
merge blocks, row-major inside a block. `vision_layout` turns the images' grids into host-side
arrays (each patch's row, column, attention segment and position-embedding corners), so the jitted
forward's shapes depend only on the number of patches.

Named axes: "position" (patches; "key_position" in attention), "patch_pixels", "embed", "qkv",
"heads", "head_size", "mlp", "grid_cell" (the learned position table), "corner" (the four
interpolation corners), "merged" (merged tokens), "merged_embed" / "merged_mlp" (a block's
concatenated patches), "out_embed" (the decoder's hidden size). In bfloat16, the LayerNorm
statistics, the rotary products and the softmax run in float32.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np

from engine.formats.checkpoint_config import read_hf_config
from engine.formats.safetensors_files import read_checkpoint
from engine.layers.transformer import ACTIVATIONS, MASKED_SCORE, KPos, Pos, TorchWeights, layer_norm

logger = logging.getLogger(__name__)

Merged = "merged"
NORM_EPS = 1e-6
"""Every LayerNorm of the tower (fixed in transformers' code, not in the config)."""
ROPE_THETA = 10000.0
_DEFAULTS = {"depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304,
             "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
             "out_hidden_size": 3584, "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]}
"""Qwen3VLVisionConfig's defaults, for the fields a config.json leaves out."""
_RENAMED = {"spatial_merge_size": "merge_size", "deepstack_visual_indexes": "deepstack_layers"}
"""config.json's keys that Qwen3VisionConfig names otherwise."""
_PREFIXES = ("model.visual.", "visual.")
"""Where a checkpoint keeps the tower: transformers' Qwen3VLForConditionalGeneration, or a bare tower."""


@dataclasses.dataclass(frozen=True)
class Qwen3VisionConfig:
    """config.json's `vision_config`, as transformers' Qwen3VLVisionConfig fills it."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    """A key of engine.layers.transformer.ACTIVATIONS: the blocks' MLP activation."""
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    out_hidden_size: int
    """The decoder's hidden size: each merged token's features."""
    num_position_embeddings: int
    """Rows of the learned position table: a square grid of that many cells."""
    deepstack_layers: tuple[int, ...]
    """`deepstack_visual_indexes`: blocks whose output a deepstack merger reads, as listed."""

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @property
    def patch_pixels(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.merge_size ** 2


def read_qwen3_vision_config(model_dir: str | Path) -> Qwen3VisionConfig:
    """The tower's sizes from config.json; ValueError naming the field the engine cannot run."""
    root = Path(model_dir).expanduser().absolute()
    hf, where = read_hf_config(root), f"{root}/config.json"
    if hf.get("model_type") != "qwen3_vl" or not isinstance(hf.get("vision_config"), dict):
        raise ValueError(f"{where} has model_type {hf.get('model_type')!r}; this tower reads a Qwen3-VL checkpoint "
                         "(model_type 'qwen3_vl' with a vision_config)")
    v = {**_DEFAULTS, **hf["vision_config"]}
    config = Qwen3VisionConfig(**{_RENAMED.get(key, key): v[key] for key in _DEFAULTS})
    config = dataclasses.replace(config, deepstack_layers=tuple(config.deepstack_layers))
    _check(config, where)
    return config


def _check(c: Qwen3VisionConfig, where: str) -> None:
    if c.hidden_act not in ACTIVATIONS:
        raise ValueError(f"{where} has vision_config.hidden_act {c.hidden_act!r}; the engine supports "
                         f"{', '.join(ACTIVATIONS)}")
    if c.hidden_size % c.num_heads or c.head_size % 4:
        raise ValueError(f"{where}: vision_config.hidden_size {c.hidden_size} / num_heads {c.num_heads} must be a "
                         "whole head size divisible by 4 (its rotary angles split between rows and columns)")
    if c.grid_side ** 2 != c.num_position_embeddings:
        raise ValueError(f"{where}: vision_config.num_position_embeddings {c.num_position_embeddings} must be a "
                         "square (the learned positions form a square grid)")
    if len(set(c.deepstack_layers)) != len(c.deepstack_layers) or not all(0 <= i < c.depth
                                                                         for i in c.deepstack_layers):
        raise ValueError(f"{where}: vision_config.deepstack_visual_indexes {list(c.deepstack_layers)} must be "
                         f"distinct block indices in 0..{c.depth - 1}")


# ---- where each patch is: host-side arrays ----


class VisionLayout(NamedTuple):
    """Per patch, in the processor's order (numpy on the host; a pytree of arrays in jit)."""

    rows: np.ndarray
    """int32 [position]: the patch's row in its image's patch grid."""
    cols: np.ndarray
    """int32 [position]: its column."""
    segments: np.ndarray
    """int32 [position]: its image (each video frame its own): patches attend within a segment."""
    corners: np.ndarray
    """int32 [position, 4]: the position-table rows interpolated to it."""
    weights: np.ndarray
    """float32 [position, 4]: their bilinear weights."""


def vision_layout(config: Qwen3VisionConfig, grids: Sequence[tuple[int, int, int]]) -> VisionLayout:
    """The layout of images whose patch grids (t, h, w) are `grids`, their patches concatenated."""
    if not grids:
        raise ValueError("vision_layout needs at least one image grid")
    parts, first_segment = [], 0
    for grid in grids:
        parts.append(_image_layout(config, grid, first_segment))
        first_segment += grid[0]
    return VisionLayout(*(np.concatenate(field) for field in zip(*parts)))


def _image_layout(config: Qwen3VisionConfig, grid: tuple[int, int, int], first_segment: int) -> VisionLayout:
    """One image's layout, its t frames one after another, segments from `first_segment` on."""
    t, h, w = grid
    m = config.merge_size
    if t < 1 or h % m or w % m or h < 1 or w < 1:
        raise ValueError(f"grid {grid} is not an image's patch grid: t >= 1 and h, w positive multiples of "
                         f"merge_size {m}; make it with the checkpoint's image processor")
    block_row, block_col, in_row, in_col = np.meshgrid(np.arange(h // m), np.arange(w // m), np.arange(m),
                                                       np.arange(m), indexing="ij")
    rows = np.tile((block_row * m + in_row).ravel(), t).astype(np.int32)
    cols = np.tile((block_col * m + in_col).ravel(), t).astype(np.int32)
    segments = np.repeat(np.arange(first_segment, first_segment + t, dtype=np.int32), h * w)
    side = config.grid_side
    row_at, col_at = _linspace32(side - 1, h)[rows], _linspace32(side - 1, w)[cols]
    row_lo, col_lo = row_at.astype(np.int32), col_at.astype(np.int32)
    row_hi, col_hi = np.minimum(row_lo + 1, side - 1), np.minimum(col_lo + 1, side - 1)
    dr, dc = row_at - row_lo.astype(np.float32), col_at - col_lo.astype(np.float32)
    one = np.float32(1)
    corners = np.stack([row_lo * side + col_lo, row_lo * side + col_hi, row_hi * side + col_lo,
                        row_hi * side + col_hi], axis=-1).astype(np.int32)
    weights = np.stack([(one - dr) * (one - dc), (one - dr) * dc, dr * (one - dc), dr * dc], axis=-1)
    return VisionLayout(rows, cols, segments, corners, weights.astype(np.float32))


def _linspace32(end: int, steps: int) -> np.ndarray:
    """torch.linspace(0, end, steps) in float32: from the start for the first half, from the end after."""
    if steps == 1:
        return np.zeros(1, np.float32)
    step = np.float32(end) / np.float32(steps - 1)
    i = np.arange(steps)
    return np.where(i < steps // 2, step * i.astype(np.float32),
                    np.float32(end) - step * (steps - 1 - i).astype(np.float32)).astype(np.float32)


# ---- the model ----


class VisionAttention(eqx.Module):
    qkv: hnn.Linear
    """embed -> (qkv, heads, head_size)."""
    proj: hnn.Linear
    """(heads, head_size) -> embed."""

    def __call__(self, x: hax.NamedArray, cos: hax.NamedArray, sin: hax.NamedArray,
                 same_segment: hax.NamedArray) -> hax.NamedArray:
        """x [position, embed]; cos, sin [position, head_size]; same_segment [position, key_position]."""
        qkv = self.qkv(x)
        q, k, v = (qkv["qkv", i] for i in range(3))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin).rename({Pos: KPos})
        scale = 1.0 / math.sqrt(q.resolve_axis("head_size").size)
        scores = hax.dot(q, k, axis="head_size", preferred_element_type=jnp.float32) * scale
        weights = hnn.softmax(hax.where(same_segment, scores, MASKED_SCORE), axis=KPos).astype(v.dtype)
        return self.proj(hax.dot(weights, v.rename({Pos: KPos}), axis=KPos))


def _rotate(x: hax.NamedArray, cos: hax.NamedArray, sin: hax.NamedArray) -> hax.NamedArray:
    """x * cos + rotate_half(x) * sin in float32, back in x's dtype."""
    half = x.resolve_axis("head_size").size // 2
    x32 = x.astype(jnp.float32)
    rotated = hax.concatenate("head_size", [-x32["head_size", half:], x32["head_size", :half]])
    return (x32 * cos + rotated * sin).astype(x.dtype)


class VisionBlock(eqx.Module):
    norm1: hnn.LayerNorm
    attn: VisionAttention
    norm2: hnn.LayerNorm
    fc1: hnn.Linear
    fc2: hnn.Linear
    act: str = eqx.field(static=True)

    def __call__(self, x, cos, sin, same_segment) -> hax.NamedArray:
        x = x + self.attn(layer_norm(self.norm1, x), cos, sin, same_segment)
        return x + self.fc2(ACTIVATIONS[self.act](self.fc1(layer_norm(self.norm2, x))))


class PatchMerger(eqx.Module):
    norm: hnn.LayerNorm
    """Over "embed" (the merger) or "merged_embed" (a deepstack merger: after the concatenation)."""
    fc1: hnn.Linear
    """merged_embed -> merged_mlp."""
    fc2: hnn.Linear
    """merged_mlp -> out_embed."""
    postshuffle_norm: bool = eqx.field(static=True)
    merge_unit: int = eqx.field(static=True)

    def __call__(self, x: hax.NamedArray) -> hax.NamedArray:
        """[position, embed] -> [merged, out_embed]: each merge_unit consecutive patches one token."""
        if not self.postshuffle_norm:
            x = layer_norm(self.norm, x)
        tokens = x.resolve_axis(Pos).size // self.merge_unit
        x = hax.unflatten_axis(x, Pos, (hax.Axis(Merged, tokens), hax.Axis("merge_unit", self.merge_unit)))
        x = hax.flatten_axes(x, ("merge_unit", "embed"), "merged_embed")
        if self.postshuffle_norm:
            x = layer_norm(self.norm, x)
        return self.fc2(ACTIVATIONS["gelu"](self.fc1(x)))


class Qwen3VisionTower(eqx.Module):
    patch_embed: hnn.Linear
    """patch_pixels -> embed: the Conv3d."""
    pos_embed: hax.NamedArray
    """[grid_cell, embed]."""
    blocks: tuple[VisionBlock, ...]
    merger: PatchMerger
    deepstack_mergers: tuple[PatchMerger, ...]
    """In `config.deepstack_layers`' order."""
    config: Qwen3VisionConfig = eqx.field(static=True)

    def __call__(self, patches: jax.Array, layout: VisionLayout) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """patches [position, patch_pixels] (several images concatenated) and their layout (as jax or
        numpy arrays) -> (features [merged, out_hidden], deepstack features: one [merged, out_hidden]
        per deepstack block, in block order), in the model's dtype."""
        dtype = self.pos_embed.dtype
        x = self.patch_embed(hax.named(jnp.asarray(patches, dtype), (Pos, "patch_pixels")))
        x = x + self._positions(layout)
        cos, sin = _rotary(self.config, layout)
        segments = jnp.asarray(layout.segments)
        same_segment = hax.named(segments[:, None] == segments[None, :], (Pos, KPos))
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, same_segment)
            if i in self.config.deepstack_layers:
                deepstack.append(self.deepstack_mergers[self.config.deepstack_layers.index(i)](x).array)
        return self.merger(x).array, tuple(deepstack)

    def _positions(self, layout: VisionLayout) -> hax.NamedArray:
        """[position, embed]: the interpolated learned positions, summed corner by corner."""
        corners = hax.named(jnp.asarray(layout.corners), (Pos, "corner"))
        weights = hax.named(jnp.asarray(layout.weights), (Pos, "corner")).astype(self.pos_embed.dtype)
        rows = hax.take(self.pos_embed, "grid_cell", corners) * weights
        return rows["corner", 0] + rows["corner", 1] + rows["corner", 2] + rows["corner", 3]


def _rotary(config: Qwen3VisionConfig, layout: VisionLayout) -> tuple[hax.NamedArray, hax.NamedArray]:
    """(cos, sin) float32 [position, head_size]: row angles, column angles, and the two again."""
    dim = config.head_size // 2
    inv_freq = 1.0 / (ROPE_THETA ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    rows, cols = (jnp.asarray(a).astype(jnp.float32)[:, None] * inv_freq for a in (layout.rows, layout.cols))
    angles = jnp.concatenate([rows, cols, rows, cols], axis=-1)
    return hax.named(jnp.cos(angles), (Pos, "head_size")), hax.named(jnp.sin(angles), (Pos, "head_size"))


def encode_images(tower: Qwen3VisionTower, patches: np.ndarray, grids: Sequence[tuple[int, int, int]]):
    """`tower` on images' concatenated patches (the processor's outputs) and their grids: (features
    [sum of image_tokens, out_hidden], deepstack features), as `Qwen3VisionTower.__call__` returns."""
    layout = vision_layout(tower.config, grids)
    if patches.shape != (len(layout.rows), tower.config.patch_pixels):
        raise ValueError(f"patches of shape {patches.shape} do not match grids {list(grids)}: expected "
                         f"({len(layout.rows)}, {tower.config.patch_pixels})")
    return tower(patches, layout)


# ---- loading ----


def load_qwen3_vision(model_dir: str | Path, dtype: str = "float32") -> Qwen3VisionTower:
    """The vision tower of a Qwen3-VL checkpoint, in `dtype` ("float32" or "bfloat16")."""
    root = Path(model_dir).expanduser().absolute()
    config = read_qwen3_vision_config(root)
    w = TorchWeights(_tower_tensors(root), jnp.dtype(dtype))
    a = _Axes.of(config)
    conv = w.tensor("patch_embed.proj.weight").reshape(config.hidden_size, -1).T  # (out, c, t, h, w) -> (in, out)
    tower = Qwen3VisionTower(
        patch_embed=w.linear("patch_embed.proj", a.patch_pixels, a.embed, weight=conv),
        pos_embed=w.array("pos_embed.weight", (a.grid_cell, a.embed)),
        blocks=tuple(_block(w, a, config, f"blocks.{i}") for i in range(config.depth)),
        merger=_merger(w, a, "merger", postshuffle_norm=False),
        deepstack_mergers=tuple(_merger(w, a, f"deepstack_merger_list.{i}", postshuffle_norm=True)
                                for i in range(len(config.deepstack_layers))),
        config=config,
    )
    logger.info("loaded Qwen3-VL vision tower %s (%d blocks, hidden %d, deepstack at %s, %s)", root, config.depth,
                config.hidden_size, list(config.deepstack_layers), dtype)
    return tower


def _tower_tensors(root: Path):
    """A lookup of the tower's tensors by their name under the tower's prefix."""
    state = read_checkpoint(root)
    prefix = next((p for p in _PREFIXES if any(key.startswith(p) for key in state)), None)
    if prefix is None:
        raise ValueError(f"{root} has no vision tower weights (no key under {' or '.join(_PREFIXES)})")

    def tensor(name: str) -> np.ndarray:
        if prefix + name not in state:
            raise ValueError(f"{root} has no weight {prefix + name!r}: an incomplete or non-Qwen3-VL checkpoint")
        return np.asarray(state[prefix + name])

    return tensor


def _block(w: TorchWeights, a: _Axes, config: Qwen3VisionConfig, p: str) -> VisionBlock:
    heads = (a.heads, a.head_size)
    return VisionBlock(
        norm1=w.norm(f"{p}.norm1", a.embed, NORM_EPS),
        attn=VisionAttention(qkv=w.linear(f"{p}.attn.qkv", a.embed, (a.qkv, *heads)),
                             proj=w.linear(f"{p}.attn.proj", heads, a.embed)),
        norm2=w.norm(f"{p}.norm2", a.embed, NORM_EPS),
        fc1=w.linear(f"{p}.mlp.linear_fc1", a.embed, a.mlp),
        fc2=w.linear(f"{p}.mlp.linear_fc2", a.mlp, a.embed),
        act=config.hidden_act,
    )


def _merger(w: TorchWeights, a: _Axes, p: str, postshuffle_norm: bool) -> PatchMerger:
    return PatchMerger(
        norm=w.norm(f"{p}.norm", a.merged_embed if postshuffle_norm else a.embed, NORM_EPS),
        fc1=w.linear(f"{p}.linear_fc1", a.merged_embed, a.merged_mlp),
        fc2=w.linear(f"{p}.linear_fc2", a.merged_mlp, a.out_embed),
        postshuffle_norm=postshuffle_norm,
        merge_unit=a.merged_embed.size // a.embed.size,
    )


class _Axes(NamedTuple):
    patch_pixels: hax.Axis
    embed: hax.Axis
    grid_cell: hax.Axis
    qkv: hax.Axis
    heads: hax.Axis
    head_size: hax.Axis
    mlp: hax.Axis
    merged_embed: hax.Axis
    merged_mlp: hax.Axis
    out_embed: hax.Axis

    @staticmethod
    def of(c: Qwen3VisionConfig) -> _Axes:
        sizes = (c.patch_pixels, c.hidden_size, c.num_position_embeddings, 3, c.num_heads, c.head_size,
                 c.intermediate_size, c.hidden_size * c.merge_unit, c.hidden_size * c.merge_unit, c.out_hidden_size)
        return _Axes(*(hax.Axis(name, size) for name, size in zip(_Axes._fields, sizes)))
