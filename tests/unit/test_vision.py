"""engine.models.vision (LLaVA's vision tower + projector) and serve_app.media.images (decoding, preprocessing).

Reference: transformers 4.57's `LlavaForConditionalGeneration.get_image_features` and its slow image
processors, on tiny random checkpoints made here (biases and norms perturbed, so a misplaced one
shows). Tolerances are measured on CPU (jax 0.10.2, torch CPU) and stated where asserted.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import struct
import zlib
from pathlib import Path

import equinox as eqx
import numpy as np
import pytest
import torch
from PIL import Image

from engine.formats.llava import language_model_files
from engine.models.vision import (
    image_features,
    image_tokens,
    load_vision,
    read_vision_config,
)
from serve_app.errors import BadRequest
from serve_app.media.images import (
    ImageProcessor,
    content_hash,
    decode_image,
    parse_data_uri,
)

IMAGE_TOKEN = 100
features = eqx.filter_jit(image_features)


def save_llava(out: Path, vision_config, text_config, processor, **llava) -> tuple[Path, object]:
    """A random LlavaForConditionalGeneration (and `processor`) saved in `out`; (out, the torch model)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    config = LlavaConfig(vision_config=vision_config, text_config=text_config, image_token_index=IMAGE_TOKEN, **llava)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in ("bias", "norm", "layrnorm", "class_embedding", "position_embedding")):
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    return out, model


def clip_vision(**kwargs):
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                            num_attention_heads=4, projection_dim=32, **kwargs)


def tiny_llama():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)


def clip_processor(**kwargs):
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(**{"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}, **kwargs})


@pytest.fixture(scope="module")
def clip_llava(tmp_path_factory):
    """CLIP (3 layers) + Llama, LLaVA-1.5's settings (feature layer -2, "default"), old key layout."""
    return save_llava(tmp_path_factory.mktemp("llava-clip"), clip_vision(), tiny_llama(), clip_processor())


@pytest.fixture(scope="module")
def clip_multi_layer(tmp_path_factory):
    """CLIP + Llama with vision_feature_layer [0, -2] (the embeddings and layer 2, concatenated), "full"."""
    return save_llava(tmp_path_factory.mktemp("llava-multi"), clip_vision(), tiny_llama(), clip_processor(),
                      vision_feature_layer=[0, -2], vision_feature_select_strategy="full",
                      multimodal_projector_bias=False)


@pytest.fixture(scope="module")
def siglip_llava(tmp_path_factory):
    """SigLIP (image 36 px, patch 8: the last 4 pixel rows/columns fall outside any patch) + Qwen2 with
    tied embeddings, feature layer -1, "full" (as llava-interleave-qwen)."""
    from transformers import Qwen2Config, SiglipImageProcessor, SiglipVisionConfig

    vision = SiglipVisionConfig(image_size=36, patch_size=8, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=4)
    text = Qwen2Config(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    processor = SiglipImageProcessor(size={"height": 36, "width": 36})
    return save_llava(tmp_path_factory.mktemp("llava-siglip"), vision, text, processor,
                      vision_feature_layer=-1, vision_feature_select_strategy="full")


def variant(source: Path, out: Path, **config) -> Path:
    """`source` with config.json's top-level fields replaced by `config` (weights linked, not copied)."""
    out.mkdir()
    for file in source.iterdir():
        (out / file.name).symlink_to(file)
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps({**json.loads((source / "config.json").read_text()), **config}))
    return out


def random_pixels(images: int, size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((images, 3, size, size)).astype(np.float32)


def reference(model, pixels: np.ndarray, **kwargs) -> np.ndarray:
    with torch.no_grad():
        return torch.stack(model.get_image_features(pixel_values=torch.from_numpy(pixels), **kwargs)).numpy()


# ---- the vision tower and projector ----


@pytest.mark.parametrize("strategy,layer", [("default", -2), ("full", -2), ("default", -1), ("full", -1),
                                            ("default", 0)])
def test_clip_features_match_transformers(clip_llava, tmp_path, strategy, layer):
    directory, hf = clip_llava
    path = variant(directory, tmp_path / "v", vision_feature_layer=layer, vision_feature_select_strategy=strategy)
    config = read_vision_config(path)
    model = load_vision(path, "float32")
    assert len(model.layers) == config.depth == layer % 4  # no layer past the selected hidden state
    for images in (1, 2):
        pixels = random_pixels(images, 32, seed=images)
        ours = np.asarray(features(model, pixels))
        ref = reference(hf, pixels, vision_feature_layer=layer, vision_feature_select_strategy=strategy)
        assert ours.shape == ref.shape == (images, image_tokens(config), 48)
        assert ours.dtype == np.float32
        assert np.abs(ours - ref).max() <= 1e-6  # measured <= 6e-8 (features up to ~0.5)


def test_concatenated_feature_layers(clip_multi_layer):
    directory, hf = clip_multi_layer
    config = read_vision_config(directory)
    assert config.feature_layers == (0, 2) and image_tokens(config) == 17
    model = load_vision(directory, "float32")
    assert len(model.layers) == 2
    pixels = random_pixels(2, 32)
    ref = reference(hf, pixels)
    assert np.abs(np.asarray(features(model, pixels)) - ref).max() <= 1e-6  # measured 2e-8 (features up to ~0.05)


def test_siglip_features_match_transformers(siglip_llava, tmp_path):
    directory, hf = siglip_llava
    for strategy in ("full", "default"):  # "default" drops SigLIP's first patch, as transformers does
        path = variant(directory, tmp_path / strategy, vision_feature_select_strategy=strategy)
        config = read_vision_config(path)
        assert config.tower == "siglip" and image_tokens(config) == 16 - (strategy == "default")
        model = load_vision(path, "float32")
        pixels = random_pixels(2, 36)
        ref = reference(hf, pixels, vision_feature_select_strategy=strategy)
        ours = np.asarray(features(model, pixels))
        assert ours.shape == ref.shape
        assert np.abs(ours - ref).max() <= 1e-6  # measured 6e-8 (features up to ~0.56)


def test_bfloat16_features(clip_llava):
    directory, hf = clip_llava
    model = load_vision(directory, "bfloat16")
    pixels = random_pixels(2, 32)
    ours = np.asarray(features(model, pixels))
    ref = reference(hf, pixels)
    assert ours.dtype == np.dtype("bfloat16")
    # bf16 weights and activations vs float32 transformers: measured 0.002 on features up to 0.51 (0.4%);
    # 0.003 on the SigLIP checkpoint
    assert np.abs(ours.astype(np.float32) - ref).max() <= 0.01


def test_new_key_layout_and_shards_load_the_same(clip_llava, tmp_path):
    """transformers >= 4.52's names (model.vision_tower..., lm_head.weight) in two shards with an index."""
    from safetensors.numpy import load_file, save_file

    directory, _ = clip_llava
    renames = {"vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector.",
               "language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head."}
    state = {}
    for key, value in load_file(directory / "model.safetensors").items():
        old = next(prefix for prefix in renames if key.startswith(prefix))
        state[renames[old] + key.removeprefix(old)] = value
    out = tmp_path / "new-layout"
    out.mkdir()
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(directory / name, out / name)
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for file, names in shards.items():
        save_file({k: state[k] for k in names}, out / file)
    weight_map = {k: file for file, names in shards.items() for k in names}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    pixels = random_pixels(2, 32)
    old = np.asarray(features(load_vision(directory, "float32"), pixels))
    assert np.array_equal(np.asarray(features(load_vision(out, "float32"), pixels)), old)
    old_config, old_state = language_model_files(directory)
    new_config, new_state = language_model_files(out)
    assert new_config == old_config and new_state.keys() == old_state.keys()
    assert all(np.array_equal(new_state[k], old_state[k]) for k in old_state)


@pytest.mark.parametrize("which", ["clip_llava", "siglip_llava"])
def test_language_model_files_make_the_same_decoder(which, request):
    from transformers import AutoConfig, AutoModelForCausalLM

    directory, hf = request.getfixturevalue(which)
    config, state = language_model_files(directory)
    assert config["model_type"] == ("llama" if which == "clip_llava" else "qwen2")
    assert config["torch_dtype"] == "float32" and config["architectures"][0].endswith("ForCausalLM")
    assert "model.embed_tokens.weight" in state and "model.layers.1.self_attn.q_proj.weight" in state
    if which == "siglip_llava":  # tied: the file has no lm_head, the embeddings are the head
        assert config["tie_word_embeddings"] and state["lm_head.weight"] is state["model.embed_tokens.weight"]
    decoder = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).eval()
    decoder.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()}, strict=True)
    tokens = torch.tensor([[1, 5, 17, 42, 99, 3]])
    with torch.no_grad():
        ours, ref = decoder(input_ids=tokens).logits, hf(input_ids=tokens).logits
    assert torch.allclose(ours, ref, rtol=0, atol=1e-6)  # measured: equal


def test_config_refusals(clip_llava, tmp_path):
    directory, _ = clip_llava
    with pytest.raises(ValueError, match="vision_feature_layer"):
        read_vision_config(variant(directory, tmp_path / "a", vision_feature_layer=4))
    with pytest.raises(ValueError, match="vision_feature_select_strategy"):
        read_vision_config(variant(directory, tmp_path / "b", vision_feature_select_strategy="cls"))
    with pytest.raises(ValueError, match="projector_hidden_act"):
        read_vision_config(variant(directory, tmp_path / "c", projector_hidden_act="relu"))
    with pytest.raises(ValueError, match="model_type 'llava_next'"):
        read_vision_config(variant(directory, tmp_path / "d", model_type="llava_next"))
    vision = {**json.loads((directory / "config.json").read_text())["vision_config"], "model_type": "dinov2"}
    with pytest.raises(ValueError, match="vision_config.model_type 'dinov2'"):
        read_vision_config(variant(directory, tmp_path / "e", vision_config=vision))
    model = load_vision(directory, "float32")
    with pytest.raises(ValueError, match=r"pixels \[images, 3, 32, 32\]"):
        image_features(model, np.zeros((1, 3, 36, 36), np.float32))


# ---- images: decoding and preprocessing ----


def test_image_tokens_and_processor_agree_with_the_model(clip_llava, siglip_llava):
    for directory in (clip_llava[0], siglip_llava[0]):
        config = read_vision_config(directory)
        assert ImageProcessor.from_dir(directory).output_size == (config.image_size, config.image_size)
    assert image_tokens(read_vision_config(clip_llava[0])) == 16  # (32 / 8)^2, class token dropped
    assert read_vision_config(clip_llava[0]).image_token_id == IMAGE_TOKEN


def test_image_features_from_processed_pixels(clip_llava):
    """End to end: a decoded image through our processor and tower equals transformers' processor + model."""
    from transformers import CLIPImageProcessor

    directory, hf = clip_llava
    image = make_image(50, 30, "RGB")
    pixels = ImageProcessor.from_dir(directory)(decode_image(png(image), 10_000))[None]
    ref_pixels = CLIPImageProcessor.from_pretrained(directory)(image, return_tensors="np")["pixel_values"]
    ref = reference(hf, ref_pixels)
    assert np.abs(np.asarray(features(load_vision(directory, "float32"), pixels)) - ref).max() <= 1e-6


def make_image(width: int, height: int, mode: str, seed: int = 0) -> Image.Image:
    """A random RGBA image, made smooth-ish (so resampling has structure), converted to `mode`."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(height // 4, 2), max(width // 4, 2), 4), dtype=np.uint8)
    image = Image.fromarray(coarse, "RGBA").resize((width, height), Image.Resampling.BILINEAR)
    noisy = np.clip(np.asarray(image).astype(int) + rng.integers(-20, 21, (height, width, 4)), 0, 255)
    image = Image.fromarray(noisy.astype(np.uint8), "RGBA")
    return image.convert("P", palette=Image.Palette.ADAPTIVE) if mode == "P" else image.convert(mode)


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("processor", [
    pytest.param(lambda: clip_processor(), id="clip"),
    pytest.param(lambda: clip_processor(size={"shortest_edge": 24}), id="clip-crop-pads"),
    pytest.param(lambda: clip_processor(size={"height": 40, "width": 36}, resample=2), id="clip-hw-bilinear"),
    pytest.param(lambda: __import__("transformers").LlavaImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, do_pad=True), id="llava-pad"),
    pytest.param(lambda: __import__("transformers").SiglipImageProcessor(size={"height": 36, "width": 36}),
                 id="siglip"),
])
def test_processor_matches_transformers(processor, tmp_path):
    reference_processor = processor()
    reference_processor.save_pretrained(tmp_path)
    ours = ImageProcessor.from_dir(tmp_path)
    for width, height in ((50, 30), (31, 77), (32, 32), (300, 200)):
        for mode in ("RGB", "RGBA", "L", "P"):
            image = make_image(width, height, mode, seed=width)
            # SigLIP's processor (do_convert_rgb None) takes RGB only: serving always converts
            rgb = image if reference_processor.do_convert_rgb else image.convert("RGB")
            ref = reference_processor(rgb, return_tensors="np")["pixel_values"][0]
            decoded = ours(decode_image(png(image), 100_000))
            assert decoded.dtype == np.float32 and decoded.shape == ref.shape
            assert np.array_equal(decoded, ref), (width, height, mode)  # measured: bit-equal
            assert np.array_equal(ours(image), ref)  # a non-RGB image is converted as transformers does


def test_decode_image_refuses_what_is_not_an_image():
    for data in (b"", b"definitely not an image", png(make_image(20, 20, "RGB"))[:60]):
        with pytest.raises(BadRequest, match="could not be decoded") as error:
            decode_image(data, 10_000)
        assert error.value.param == "messages"
    tiff = io.BytesIO()
    make_image(8, 8, "RGB").save(tiff, "TIFF")
    with pytest.raises(BadRequest, match="PNG, JPEG, WebP, GIF or BMP"):
        decode_image(tiff.getvalue(), 10_000)


def test_decode_image_refuses_too_many_pixels_before_decoding():
    data = png(make_image(50, 30, "RGB"))
    with pytest.raises(BadRequest, match="50x30 = 1500 pixels.*at most 1499") as error:
        decode_image(data, 1499)
    assert error.value.param == "messages"
    assert decode_image(data, 1500).size == (50, 30)
    # PNG headers claiming huge sizes over a few bytes of data: refused without decoding a pixel
    # (past 2 * Image.MAX_IMAGE_PIXELS, Pillow itself refuses to open the file).
    with pytest.raises(BadRequest, match="12000x12000 = 144000000 pixels"):
        decode_image(png_claiming(12000, 12000), 10_000_000)
    with pytest.raises(BadRequest, match="too large") as error:
        decode_image(png_claiming(20000, 20000), 10_000_000)
    assert error.value.param == "messages"


def png_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header (IHDR, with a valid CRC) says width x height."""
    data = bytearray(png(Image.new("L", (1, 1))))
    start = data.index(b"IHDR")
    data[start + 4: start + 12] = struct.pack(">II", width, height)
    data[start + 17: start + 21] = struct.pack(">I", zlib.crc32(bytes(data[start: start + 17])))
    return bytes(data)


def test_decode_image_converts_as_transformers_load_image():
    from transformers.image_utils import load_image

    rotated = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # EXIF orientation: rotate 90 degrees clockwise to display
    make_image(40, 20, "RGB").save(rotated, "JPEG", exif=exif)
    for data in (rotated.getvalue(), png(make_image(30, 20, "RGBA")), png(make_image(30, 20, "P"))):
        ours = decode_image(data, 10_000)
        assert ours.mode == "RGB"
        assert np.array_equal(np.asarray(ours), np.asarray(load_image(Image.open(io.BytesIO(data)))))
    assert decode_image(rotated.getvalue(), 10_000).size == (20, 40)


def test_animated_gif_takes_its_first_frame():
    frames = [Image.new("RGB", (16, 12), color) for color in ((255, 0, 0), (0, 0, 255), (0, 255, 0))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    image = decode_image(buffer.getvalue(), 10_000)
    assert image.mode == "RGB" and image.size == (16, 12)
    assert (np.asarray(image) == np.array([255, 0, 0], np.uint8)).all()


def test_parse_data_uri():
    data = png(make_image(8, 8, "RGB"))
    encoded = base64.b64encode(data).decode()
    assert parse_data_uri(f"data:image/png;base64,{encoded}") == data
    assert parse_data_uri(f"DATA:Image/JPEG;charset=utf-8;base64,{encoded[:40]}\n{encoded[40:]}") == data
    assert parse_data_uri("data:image/x-test,%01%02abc") == b"\x01\x02abc"
    for url, message in ((f"data:image/png;base64{encoded}", "no ','"),
                         ("data:image/png;base64,not*base64!", "not valid base64"),
                         ("data:image/png;base64,", "holds no data"),
                         (f"data:text/plain;base64,{encoded}", "media type 'text/plain'"),
                         (f"data:;base64,{encoded}", "media type '\\(none\\)'"),
                         ("https://example.com/cat.png", "must be a data URI")):
        with pytest.raises(BadRequest, match=message) as error:
            parse_data_uri(url)
        assert error.value.param == "messages"


def test_content_hash():
    pixels = np.arange(12, dtype=np.float32).reshape(3, 2, 2)
    digest = content_hash(pixels)
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert content_hash(pixels.copy()) == digest
    assert content_hash(np.asfortranarray(pixels)) == digest  # the values, not the memory layout
    assert content_hash(pixels.reshape(3, 4, 1)) != digest
    changed = pixels.copy()
    changed[0, 0, 0] = 0.5
    assert content_hash(changed) != digest


def test_processor_config_refusals(tmp_path):
    with pytest.raises(ValueError, match="no preprocessor_config.json"):
        ImageProcessor.from_dir(tmp_path)
    with pytest.raises(ValueError, match="image_processor_type 'Qwen2VLImageProcessor'"):
        ImageProcessor.from_config({"image_processor_type": "Qwen2VLImageProcessor"})
    with pytest.raises(ValueError, match="size"):
        ImageProcessor.from_config({"image_processor_type": "SiglipImageProcessor", "size": {"shortest_edge": 9}})
    with pytest.raises(ValueError, match="image_mean"):
        ImageProcessor.from_config({"image_mean": [0.5, 0.5]})
    strip = ImageProcessor.from_config({"size": {"shortest_edge": 336}})
    with pytest.raises(BadRequest, match="aspect ratio"):
        strip(Image.new("RGB", (200_000, 1)))


def test_serving_side_imports_no_jax_torch_or_transformers():
    import subprocess
    import sys

    code = "import sys, serve_app.media.images; print([m for m in ('jax', 'torch', 'transformers') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[2])
    assert out.stdout.strip() == "[]"
