"""The image front end of Qwen-VL chat (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): an RGB image to the vision
tower's flattened patches, pure numpy + Pillow (no jax, torch or transformers here).

What transformers' `Qwen2VLImageProcessor` (and the `...Fast` one that Qwen's preprocessor_config.json
names) computes for one image:

- `smart_resize`: height and width rounded to multiples of `factor` = patch_size * merge_size, then,
  if the area is above `max_pixels` (below `min_pixels`), scaled down (up) keeping the aspect ratio,
  rounding each side down (up) to a multiple of `factor`. Python's `round` (half to even) as there.
- a PIL resize to that size (`resample`, bicubic by default) of the uint8 image, rescale in float64
  then float32, and (x - mean) / std in float32: the same arithmetic as serve_app.media.images.
- the image repeated to `temporal_patch_size` frames, then cut into patches in the processor's order:
  row-major over 2x2 (merge_size x merge_size) blocks of patches, row-major inside a block, each patch
  flattened as (channel, frame, pixel_row, pixel_col). So the tower's merger sees each block as
  merge_size^2 consecutive rows.

Invariant: `patches` has grid_t * grid_h * grid_w rows of channels * temporal_patch_size * patch_size^2
float32 values, grid_t = 1 for an image, grid_h and grid_w multiples of merge_size; the prompt holds
`image_tokens(grid)` = grid_t * grid_h * grid_w / merge_size^2 placeholder tokens for it.

The size limits follow the Fast processor, which reads `size: {shortest_edge, longest_edge}` (pixels,
not edges) with `min_pixels` / `max_pixels` overriding either. (The slow processor's constructor
drops a `size` given without min_pixels/max_pixels and uses its defaults; its `preprocess(size=...)`
reads it as the Fast one does.)
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
from PIL import Image

from serve_app.errors import BadRequest
from serve_app.media.images import preprocessor_config

PARAM = "messages"
"""The request field an image error points at: images arrive in chat messages."""
MAX_ASPECT_RATIO = 200
"""smart_resize refuses images whose long side is more than this many times the short one."""
_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast")
_DEFAULT_SIZE = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}
_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) the processor resizes a height x width image to: multiples of `factor`, the area
    within [min_pixels, max_pixels] where rounding allows, the aspect ratio kept as well as it can be.
    BadRequest for an aspect ratio over MAX_ASPECT_RATIO."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise BadRequest(f"the image is {width}x{height} pixels: its aspect ratio is over {MAX_ASPECT_RATIO}, "
                         "which Qwen-VL's image processor refuses; crop or pad it", PARAM)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if h_bar < factor or w_bar < factor:
        raise BadRequest(f"the image is {width}x{height} pixels, too small for this model's image processor "
                         f"(it needs at least {factor} pixels a side after resizing); send a larger image", PARAM)
    return h_bar, w_bar


def image_tokens(grid: tuple[int, int, int], merge_size: int) -> int:
    """Placeholder tokens an image of patch grid (t, h, w) takes in the prompt: one per merged block."""
    t, h, w = grid
    return t * h * w // (merge_size * merge_size)


@dataclasses.dataclass(frozen=True)
class QwenVLImageProcessor:
    """A Qwen-VL checkpoint's image preprocessing (preprocessor_config.json). A step whose field is
    None is skipped."""

    min_pixels: int
    max_pixels: int
    """The resized image's area bounds (`size.shortest_edge` / `size.longest_edge`)."""
    patch_size: int
    temporal_patch_size: int
    """Frames per patch: an image is repeated this many times."""
    merge_size: int
    """Patches per side of a block the tower merges into one token."""
    resample: int
    """PIL's resampling filter code (3 = bicubic)."""
    rescale_factor: float | None
    mean: tuple[float, float, float] | None
    """With `std`: normalize (x - mean) / std per channel."""
    std: tuple[float, float, float] | None

    @staticmethod
    def from_dir(model_dir: str | Path) -> QwenVLImageProcessor:
        """The processor of a checkpoint's preprocessor_config.json; ValueError naming what to change."""
        return QwenVLImageProcessor.from_config(*preprocessor_config(model_dir, "a Qwen-VL model"))

    @staticmethod
    def from_config(config: dict, where: str = "preprocessor_config.json") -> QwenVLImageProcessor:
        name = config.get("image_processor_type", _PROCESSORS[1])
        if name not in _PROCESSORS:
            raise ValueError(f"{where} has image_processor_type {name!r}; a Qwen-VL model's images are processed "
                             f"by {' or '.join(_PROCESSORS)}")
        if not config.get("do_resize", True):
            raise ValueError(f"{where} has do_resize false; the server resizes every image to multiples of "
                             "patch_size * merge_size: set do_resize to true")
        min_pixels, max_pixels = _pixel_bounds(config, where)
        normalize = config.get("do_normalize", True)
        mean = _per_channel(config.get("image_mean", _OPENAI_CLIP_MEAN), "image_mean", where)
        std = _per_channel(config.get("image_std", _OPENAI_CLIP_STD), "image_std", where)
        return QwenVLImageProcessor(
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            patch_size=_positive(config, "patch_size", 14, where),
            temporal_patch_size=_positive(config, "temporal_patch_size", 2, where),
            merge_size=_positive(config, "merge_size", 2, where),
            resample=int(config.get("resample", Image.Resampling.BICUBIC)),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)) if config.get("do_rescale", True) else None,
            mean=mean if normalize else None,
            std=std if normalize else None,
        )

    @property
    def factor(self) -> int:
        """What both resized sides are multiples of: one merged block's side in pixels."""
        return self.patch_size * self.merge_size

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """The patch grid (t, h, w) of a height x width image."""
        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def image_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens a height x width image takes in the prompt."""
        return image_tokens(self.grid(height, width), self.merge_size)

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """(patches float32 [t*h*w, 3 * temporal_patch_size * patch_size^2], grid (t, h, w)) of `image`
        (converted to RGB if it is not)."""
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        height, width = smart_resize(rgb.height, rgb.width, self.factor, self.min_pixels, self.max_pixels)
        pixels = np.asarray(rgb.resize((width, height), resample=self.resample))  # uint8 [H, W, 3]
        return self._patches(self._normalized(pixels)), (1, height // self.patch_size, width // self.patch_size)

    def _normalized(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 [H, W, 3] -> float32 [3, H, W], rescaled and normalized as transformers does."""
        out = pixels
        if self.rescale_factor is not None:
            out = (out.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.mean is not None:
            out = out if np.issubdtype(out.dtype, np.floating) else out.astype(np.float32)
            out = (out - np.array(self.mean, np.float32)) / np.array(self.std, np.float32)
        return out.transpose(2, 0, 1).astype(np.float32)

    def _patches(self, chw: np.ndarray) -> np.ndarray:
        """float32 [C, H, W] -> [grid_h * grid_w, C * T * P * P] in the processor's patch order."""
        channels, height, width = chw.shape
        t, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        grid_h, grid_w = height // p, width // p
        frames = np.broadcast_to(chw[None], (t, channels, height, width))
        blocks = frames.reshape(t, channels, grid_h // m, m, p, grid_w // m, m, p)
        # -> (block_row, block_col, row_in_block, col_in_block, channel, frame, pixel_row, pixel_col)
        ordered = blocks.transpose(2, 5, 3, 6, 1, 0, 4, 7)
        return np.ascontiguousarray(ordered.reshape(grid_h * grid_w, channels * t * p * p), dtype=np.float32)


def _pixel_bounds(config: dict, where: str) -> tuple[int, int]:
    """(min_pixels, max_pixels): `size`'s shortest_edge / longest_edge, either overridden by
    min_pixels / max_pixels, as the Fast processor reads them."""
    size = config.get("size")
    if size is None:
        size = dict(_DEFAULT_SIZE)
    if not isinstance(size, dict):
        raise ValueError(f"{where} has size {size!r}; a Qwen-VL processor takes "
                         "{'shortest_edge': min_pixels, 'longest_edge': max_pixels}")
    bounds = {**size}
    if config.get("min_pixels") is not None:
        bounds["shortest_edge"] = config["min_pixels"]
    if config.get("max_pixels") is not None:
        bounds["longest_edge"] = config["max_pixels"]
    if "shortest_edge" not in bounds or "longest_edge" not in bounds:
        raise ValueError(f"{where} has size {size!r}; it needs both 'shortest_edge' (the least pixels of a "
                         "resized image) and 'longest_edge' (the most), or give min_pixels and max_pixels")
    low, high = bounds["shortest_edge"], bounds["longest_edge"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high)) or not 0 < low <= high:
        raise ValueError(f"{where}: the pixel bounds {low!r}..{high!r} (size.shortest_edge / min_pixels .. "
                         "size.longest_edge / max_pixels) must be integers with 0 < min <= max")
    return low, high


def _positive(config: dict, field: str, default: int, where: str) -> int:
    value = config.get(field, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where} has {field} {value!r}; it must be a positive integer")
    return value


def _per_channel(value, field: str, where: str) -> tuple[float, float, float]:
    """A per-channel value: a number is the same for R, G and B."""
    values = [value] * 3 if isinstance(value, (int, float)) else list(value)
    if len(values) != 3:
        raise ValueError(f"{where} has {field} {value!r}; give one number or three (R, G, B)")
    return tuple(float(v) for v in values)
