"""The image front end of LLaVA-style chat: uploaded bytes to the vision tower's pixels.

This module owns three steps, pure numpy + Pillow (no jax, torch or transformers here):

- `parse_data_uri`: a `data:image/...;base64,...` URL (an OpenAI `image_url` content part) to bytes.
- `decode_image`: bytes of a PNG, JPEG, WebP, GIF or BMP file to an RGB Pillow image, as
  transformers' `load_image` makes one: EXIF orientation applied (`ImageOps.exif_transpose`), then
  `convert("RGB")`, which drops an alpha channel (RGBA keeps its colour values; nothing is composited
  onto a background) and applies a palette. An animated image gives its first frame.
  Invariants: a Pillow exception never escapes, every failure caused by the upload is a `BadRequest`
  with param "messages"; the size is checked from the header before any pixel is decoded, so memory
  and time are bounded by `max_pixels`, not by the file.
- `ImageProcessor`: an RGB image to float32 [3, H, W], numerically what transformers' slow
  `CLIPImageProcessor` (or `LlavaImageProcessor`, `SiglipImageProcessor`) returns for it, read from
  the checkpoint's preprocessor_config.json: optional padding to a square with the mean colour
  (LLaVA), a PIL resize (shortest edge to `size`, the other edge `int(size * long / short)`; or to
  height x width), a center crop at `(old - new) // 2` (zero padding where the image is smaller),
  rescale in float64 then float32, and (x - mean) / std in float32.

`content_hash` names processed pixels for the prefix cache: equal hashes mean equal model inputs.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import json
import math
import struct
import urllib.error
import urllib.parse
import urllib.request
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from serve_app.errors import BadRequest

ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""Pillow's names of the formats decoded: OpenAI's four and BMP. Others (EPS runs Ghostscript, TIFF
and the rarer codecs widen the attack surface) are refused before a decoder runs."""
PARAM = "messages"
"""The request field an image error points at: images arrive in chat messages."""
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error)
"""What Pillow raises for a file it cannot read (UnidentifiedImageError and truncation are OSErrors;
broken PNG chunks raise SyntaxError; odd headers struct.error, EOFError, IndexError, ValueError)."""
_MAX_RESIZED_PIXELS = 1 << 25
"""The largest intermediate image a resize may make (~100 MB of RGB): only an extreme aspect ratio
resized on its shortest edge gets there (a 1 x 10^6 strip to 32 x 32 000 000)."""
_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_IMAGENET_STANDARD = (0.5, 0.5, 0.5)
_PROCESSORS = {"CLIPImageProcessor": "clip", "CLIPFeatureExtractor": "clip", "LlavaImageProcessor": "llava",
               "SiglipImageProcessor": "siglip"}
"""preprocessor_config.json's image_processor_type (a "Fast" suffix dropped) -> the steps it takes."""


def parse_data_uri(url: str) -> bytes:
    """The bytes of a `data:image/<type>[;base64],<data>` URI (RFC 2397); BadRequest (param "messages")
    for anything else: another scheme, no comma, a media type other than image/*, bad base64, no data."""
    if not url[:5].lower() == "data:":
        raise BadRequest("an image URL must be a data URI (data:image/png;base64,...) here; http(s) URLs are "
                         "fetched only from the hosts the server allows (image_url_hosts)", PARAM)
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise BadRequest("malformed image data URI: no ',' between the media type and the data; send "
                         "data:image/png;base64,<base64 data>", PARAM)
    media_type, *params = (part.strip().lower() for part in header.split(";"))
    if not media_type.startswith("image/"):
        raise BadRequest(f"the image data URI has media type {media_type or '(none)'!r}; send an image "
                         "(image/png, image/jpeg, image/webp, image/gif)", PARAM)
    if "base64" in params:
        try:
            data = base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError) as e:
            raise BadRequest(f"malformed image data URI: its data is not valid base64 ({e})", PARAM) from e
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if not data:
        raise BadRequest("the image data URI holds no data", PARAM)
    return data


def fetch_image(url: str, hosts: frozenset[str], max_bytes: int, timeout_s: float) -> bytes:
    """The body of an http(s) image URL whose host the operator allows (`hosts`, exact names);
    BadRequest (param "messages") for another scheme or host, a redirect (not followed: it could
    lead anywhere), an error status, no answer within `timeout_s`, or a body over `max_bytes`."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise BadRequest("an image URL must be a data: URI or an http(s) URL", PARAM)
    if parsed.hostname.lower() not in hosts:
        allowed = ", ".join(sorted(hosts)) or "none: send images as data: URIs"
        raise BadRequest(f"this server fetches images only from the hosts it allows ({allowed}), not "
                         f"{parsed.hostname!r}; send the image inline as a data: URI", PARAM)
    opener = urllib.request.build_opener(_NoRedirects)
    try:
        request = urllib.request.Request(url, headers={"User-Agent": "jax-serve"})
        with opener.open(request, timeout=timeout_s) as answer:
            data = answer.read(max_bytes + 1)
    except urllib.error.HTTPError as exc:
        raise BadRequest(f"fetching the image {url!r} failed: HTTP {exc.code} ({exc.reason})", PARAM) from None
    except (urllib.error.URLError, OSError) as exc:
        raise BadRequest(f"fetching the image {url!r} failed: {exc}", PARAM) from None
    if len(data) > max_bytes:
        raise BadRequest(f"the image at {url!r} is larger than this server's limit of {max_bytes} bytes", PARAM)
    return data


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an error: its target's host was not checked."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, f"redirected to {newurl}; not followed", headers, fp)


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """An RGB Pillow image of `data` (see the module docstring for how it is converted).

    Raises BadRequest (param "messages") for bytes that are not an image in ACCEPTED_FORMATS, a damaged
    or truncated file, or an image of more than `max_pixels` pixels (checked before decoding).
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # max_pixels is checked below
            image = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
    except Image.DecompressionBombError as e:
        raise BadRequest(f"the image is too large ({e}); send at most {max_pixels} pixels", PARAM) from e
    except _DECODE_ERRORS as e:
        raise _not_an_image(e) from e
    with image:
        width, height = image.size
        if width < 1 or height < 1:
            raise BadRequest(f"the image is {width}x{height} pixels: it has no pixels to see", PARAM)
        if width * height > max_pixels:
            raise BadRequest(f"the image is {width}x{height} = {width * height} pixels; the server accepts at "
                             f"most {max_pixels} pixels per image: send a smaller image", PARAM)
        try:
            image.seek(0)  # an animated image: its first frame
            return ImageOps.exif_transpose(image).convert("RGB")
        except _DECODE_ERRORS as e:
            raise _not_an_image(e) from e


def _not_an_image(error: Exception) -> BadRequest:
    return BadRequest(f"the image could not be decoded ({type(error).__name__}: {error}); send a PNG, JPEG, "
                      "WebP, GIF or BMP file", PARAM)


def content_hash(pixels: np.ndarray) -> str:
    """Hex sha256 of processed pixels: their dtype, shape and bytes (C order)."""
    digest = hashlib.sha256(f"{pixels.dtype.str}{tuple(pixels.shape)}".encode())
    digest.update(np.ascontiguousarray(pixels).data)
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class ImageProcessor:
    """A checkpoint's image preprocessing (preprocessor_config.json), as the slow transformers
    processors run it. A step whose field is None is skipped."""

    pad_color: tuple[int, int, int] | None
    """LlavaImageProcessor's do_pad: pad to a square (centred) with this colour, int(mean * 255)."""
    shortest_edge: int | None
    """Resize the shorter side to this, the longer keeping the aspect ratio (truncated)."""
    resize_to: tuple[int, int] | None
    """Or resize to (height, width)."""
    resample: int
    """PIL's resampling filter code (3 = bicubic)."""
    crop_size: tuple[int, int] | None
    """Center crop to (height, width)."""
    rescale_factor: float | None
    mean: tuple[float, float, float] | None
    """With `std`: normalize (x - mean) / std per channel."""
    std: tuple[float, float, float] | None

    @staticmethod
    def from_dir(model_dir: str | Path) -> ImageProcessor:
        """The processor of a checkpoint's preprocessor_config.json; ValueError naming the field it cannot run."""
        return ImageProcessor.from_config(*preprocessor_config(model_dir, "an image model"))

    @staticmethod
    def from_config(config: dict, where: str = "preprocessor_config.json") -> ImageProcessor:
        name = config.get("image_processor_type") or config.get("feature_extractor_type") or "CLIPImageProcessor"
        kind = _PROCESSORS.get(name.removesuffix("Fast"))
        if kind is None:
            raise ValueError(f"{where} has image_processor_type {name!r}; the server runs "
                             f"{', '.join(_PROCESSORS)} (LLaVA-1.5-style models)")
        clip = kind != "siglip"
        mean = _triple(config.get("image_mean", _OPENAI_CLIP_MEAN if clip else _IMAGENET_STANDARD), "image_mean", where)
        std = _triple(config.get("image_std", _OPENAI_CLIP_STD if clip else _IMAGENET_STANDARD), "image_std", where)
        shortest_edge, resize_to = _resize(config, clip, where) if config.get("do_resize", True) else (None, None)
        crop = clip and config.get("do_center_crop", True)
        normalize = config.get("do_normalize", True)
        return ImageProcessor(
            pad_color=tuple(int(x * 255) for x in mean) if kind == "llava" and config.get("do_pad") else None,
            shortest_edge=shortest_edge,
            resize_to=resize_to,
            resample=int(config.get("resample", Image.Resampling.BICUBIC)),
            crop_size=_crop_size(config.get("crop_size", 224), where) if crop else None,
            rescale_factor=float(config.get("rescale_factor", 1 / 255)) if config.get("do_rescale", True) else None,
            mean=mean if normalize else None,
            std=std if normalize else None,
        )

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every output, or None where it depends on the image (no crop, shortest-edge resize)."""
        return self.crop_size or self.resize_to

    def __call__(self, image: Image.Image) -> np.ndarray:
        """float32 [3, H, W] pixels of `image` (converted to RGB if it is not)."""
        pixels = np.asarray(image if image.mode == "RGB" else image.convert("RGB"))  # uint8 [H, W, 3]
        if self.pad_color is not None:
            pixels = _pad_to_square(pixels, self.pad_color)
        size = self._resized_size(*pixels.shape[:2])
        if size is not None:
            pixels = np.asarray(Image.fromarray(pixels).resize((size[1], size[0]), resample=self.resample))
        if self.crop_size is not None:
            pixels = _center_crop(pixels, self.crop_size)
        out = pixels
        if self.rescale_factor is not None:
            out = (out.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.mean is not None:
            out = out if np.issubdtype(out.dtype, np.floating) else out.astype(np.float32)
            out = (out - np.array(self.mean, np.float32)) / np.array(self.std, np.float32)
        return np.ascontiguousarray(out.transpose(2, 0, 1), dtype=np.float32)

    def _resized_size(self, height: int, width: int) -> tuple[int, int] | None:
        """(height, width) after the resize, as transformers' `get_resize_output_image_size` computes it."""
        if self.resize_to is not None:
            return self.resize_to
        if self.shortest_edge is None:
            return None
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(self.shortest_edge * long / short)
        if self.shortest_edge * new_long > _MAX_RESIZED_PIXELS:
            raise BadRequest(f"the image's aspect ratio ({width}x{height}) is too extreme to process: resized to "
                             f"{self.shortest_edge} pixels on its short side it would be {new_long} long", PARAM)
        return (new_long, self.shortest_edge) if width <= height else (self.shortest_edge, new_long)


def preprocessor_config(model_dir: str | Path, who: str) -> tuple[dict, str]:
    """(preprocessor_config.json of a checkpoint, its path); a ValueError naming the missing file,
    which `who` (e.g. "an image model") needs."""
    path = Path(model_dir).expanduser().absolute() / "preprocessor_config.json"
    if not path.is_file():
        raise ValueError(f"{path.parent} has no preprocessor_config.json; {who} needs its image processor's "
                         "config (save it with the processor's save_pretrained)")
    return json.loads(path.read_text()), str(path)


def _resize(config: dict, clip: bool, where: str) -> tuple[int | None, tuple[int, int] | None]:
    """(shortest_edge, (height, width)): one of them, from `size` as transformers' get_size_dict reads it."""
    size = config.get("size", {"shortest_edge": 224} if clip else {"height": 224, "width": 224})
    if isinstance(size, int):
        size = {"shortest_edge": size}
    elif isinstance(size, (list, tuple)) and len(size) == 2:
        size = {"height": size[0], "width": size[1]}
    if clip and set(size) == {"shortest_edge"} and config.get("use_square_size"):
        size = {"height": size["shortest_edge"], "width": size["shortest_edge"]}
    if clip and isinstance(size, dict) and set(size) == {"shortest_edge"}:
        return int(size["shortest_edge"]), None
    if isinstance(size, dict) and set(size) == {"height", "width"}:
        return None, (int(size["height"]), int(size["width"]))
    accepted = "{'shortest_edge': n} or {'height': h, 'width': w}" if clip else "{'height': h, 'width': w}"
    raise ValueError(f"{where} has size {size!r}; the server resizes to {accepted}")


def _crop_size(crop, where: str) -> tuple[int, int]:
    if isinstance(crop, int):
        return crop, crop
    if isinstance(crop, dict) and set(crop) == {"height", "width"}:
        return int(crop["height"]), int(crop["width"])
    raise ValueError(f"{where} has crop_size {crop!r}; the server crops to {{'height': h, 'width': w}} or an int")


def _triple(value, field: str, where: str) -> tuple[float, float, float]:
    """A per-channel value: a number is the same for R, G and B."""
    values = [value] * 3 if isinstance(value, (int, float)) else list(value)
    if len(values) != 3:
        raise ValueError(f"{where} has {field} {value!r}; give one number or three (R, G, B)")
    return tuple(float(v) for v in values)


def _pad_to_square(pixels: np.ndarray, color: tuple[int, int, int]) -> np.ndarray:
    """LlavaImageProcessor.pad_to_square: [H, W, 3] centred in a max(H, W) square of `color`."""
    height, width = pixels.shape[:2]
    if height == width:
        return pixels
    side = max(height, width)
    out = np.empty((side, side, 3), pixels.dtype)
    out[...] = np.array(color, pixels.dtype)
    top, left = ((side - height) // 2, 0) if width > height else (0, (side - width) // 2)
    out[top: top + height, left: left + width] = pixels
    return out


def _center_crop(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """transformers' center_crop on [H, W, C]: offsets (old - new) // 2, zero padding (centred, the
    odd pixel after) where the image is smaller than the crop."""
    height, width = pixels.shape[:2]
    crop_h, crop_w = size
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    if top >= 0 and left >= 0:
        return pixels[top: top + crop_h, left: left + crop_w]
    new_h, new_w = max(crop_h, height), max(crop_w, width)
    padded = np.zeros((new_h, new_w) + pixels.shape[2:], pixels.dtype)
    top_pad, left_pad = math.ceil((new_h - height) / 2), math.ceil((new_w - width) / 2)
    padded[top_pad: top_pad + height, left_pad: left_pad + width] = pixels
    top, left = top + top_pad, left + left_pad
    return padded[max(0, top): min(new_h, top + crop_h), max(0, left): min(new_w, left + crop_w)]
