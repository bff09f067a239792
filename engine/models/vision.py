"""The vision side of a LLaVA-1.5-style model in haliax + equinox: images to the decoder's embeddings.

Reads a Hugging Face `LlavaForConditionalGeneration` checkpoint directory: config.json
(model_type "llava": `vision_config`, `text_config`, `vision_feature_layer`,
`vision_feature_select_strategy`, `image_token_index`/`image_token_id`, `projector_hidden_act`,
`multimodal_projector_bias`) and the tower's and projector's safetensors weights, through
engine.formats.llava (the files, either key layout, and the decoder's own files).

The forward pass is transformers' `LlavaModel.get_image_features`:
  * patch embedding: the image cut into patch_size x patch_size patches, row by row (a convolution with
    stride = kernel = patch size, computed as one matmul); pixels past the last whole patch are
    dropped, as the convolution drops them. CLIP puts a class token first and has no bias; SigLIP has
    no class token and a bias. Plus learned position embeddings.
  * CLIP only: `pre_layrnorm`. The result is hidden state 0.
  * engine.layers.transformer's encoder layers, pre-norm (bidirectional self-attention and an MLP;
    CLIP: quick_gelu, SigLIP: gelu_pytorch_tanh), the scores accumulated in float32 and then scaled;
    hidden state i is layer i's output. The post-layernorm (and SigLIP's
    pooling head) never reach LLaVA's features, so they are not loaded.
  * the hidden state `vision_feature_layer` picks (a list: those, concatenated on the embedding axis,
    in the list's order); "default" drops position 0 (CLIP's class token; with SigLIP, the first
    patch, as transformers does), "full" keeps every position.
  * the projector: linear_1, `projector_hidden_act`, linear_2, to the decoder's hidden size.
Only the layers up to the deepest selected hidden state are loaded and run.

Named axes: "image", "channel", "patch_row"/"patch_col" (which patch), "pixel_row"/"pixel_col"
(the pixel inside a patch), the layers' ("position": the tower's tokens, "key_position", "embed",
...), "feature_layer" (the selected hidden states), "projection" (linear_1's output), "text_embed"
(the decoder's hidden size). Weights are stored
(In..., Out...), as `loading.inputs_first` lays out the decoder's, so no call transposes a weight.
In bfloat16, the LayerNorm statistics and the softmax (and its scores) run in float32.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np

from engine.formats.checkpoint_config import declared_dtype
from engine.formats.llava import TOWERS, Layout, llava_configs, read_tensors
from engine.layers.transformer import (
    ACTIVATIONS,
    EncoderLayer,
    EncoderSizes,
    LayerAxes,
    LayerKeys,
    Pos,
    TorchWeights,
    layer_norm,
    load_encoder_layer,
)

logger = logging.getLogger(__name__)

Image = "image"
_STRATEGIES = ("default", "full")


@dataclasses.dataclass(frozen=True)
class VisionConfig(EncoderSizes):
    """The sizes of a LLaVA vision tower and projector, from config.json (as transformers fills it).
    `num_layers` counts the tower's layers; only `depth` of them run."""

    tower: str
    """"clip" or "siglip"."""
    image_size: int
    patch_size: int
    feature_layers: tuple[int, ...]
    """The hidden states fed to the projector, as indices in 0..num_layers (0 is the embeddings), in the
    order they are concatenated; `vision_feature_layer` with negative indices resolved."""
    select_strategy: str
    """"default" drops position 0 of each selected state, "full" keeps it."""
    text_hidden_size: int
    projector_act: str
    projector_bias: bool
    image_token_id: int
    """The prompt's placeholder token: each copy takes one row of `image_features`."""
    dtype: str
    """The weights' dtype as config.json declares it (engine.formats.checkpoint_config.declared_dtype)."""

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size

    @property
    def class_token(self) -> bool:
        return self.tower == "clip"

    @property
    def positions(self) -> int:
        """Tokens through the tower: the patches, after CLIP's class token."""
        return self.grid ** 2 + int(self.class_token)

    @property
    def depth(self) -> int:
        """Layers to run: the deepest selected hidden state's."""
        return max(self.feature_layers)


def read_vision_config(model_dir: str | Path) -> VisionConfig:
    """config.json's vision tower and projector (no weights). ValueError naming the field the engine
    does not support."""
    root = Path(model_dir).expanduser().absolute()
    hf, vision, text = llava_configs(root)
    where = f"{root}/config.json"
    if vision.get("num_channels", 3) != 3:
        raise ValueError(f"{where} has vision_config.num_channels {vision['num_channels']}; the engine feeds RGB "
                         "images (3 channels)")
    if vision["hidden_size"] % vision["num_attention_heads"]:
        raise ValueError(f"{where}: vision_config.hidden_size {vision['hidden_size']} is not a multiple of "
                         f"num_attention_heads {vision['num_attention_heads']}")
    for field, act in (("vision_config.hidden_act", vision["hidden_act"]),
                       ("projector_hidden_act", hf.get("projector_hidden_act", "gelu"))):
        if act not in ACTIVATIONS:
            raise ValueError(f"{where} has {field} {act!r}; the engine supports {', '.join(ACTIVATIONS)}")
    strategy = hf.get("vision_feature_select_strategy", "default")
    if strategy not in _STRATEGIES:
        raise ValueError(f"{where} has vision_feature_select_strategy {strategy!r}; transformers and the engine "
                         f"take {' or '.join(map(repr, _STRATEGIES))}")
    return VisionConfig(
        tower=TOWERS[vision["model_type"]],
        hidden_size=vision["hidden_size"],
        num_layers=vision["num_hidden_layers"],
        num_heads=vision["num_attention_heads"],
        intermediate_size=vision["intermediate_size"],
        image_size=vision["image_size"],
        patch_size=vision["patch_size"],
        layer_norm_eps=vision["layer_norm_eps"],
        hidden_act=vision["hidden_act"],
        feature_layers=_feature_layers(hf.get("vision_feature_layer", -2), vision["num_hidden_layers"], where),
        select_strategy=strategy,
        text_hidden_size=text["hidden_size"],
        projector_act=hf.get("projector_hidden_act", "gelu"),
        projector_bias=bool(hf.get("multimodal_projector_bias", True)),
        image_token_id=int(hf.get("image_token_index", hf.get("image_token_id", 32000))),
        dtype=declared_dtype(hf),
    )


def image_tokens(config: VisionConfig) -> int:
    """Placeholder tokens one image takes in the prompt: the tower's positions, less position 0 with
    "default" (CLIP: (image_size / patch_size)^2, +1 with "full")."""
    return config.positions - int(config.select_strategy == "default")


def _feature_layers(layer, num_layers: int, where: str) -> tuple[int, ...]:
    """`vision_feature_layer` (an int or a list) as hidden-state indices in 0..num_layers."""
    layers = [layer] if isinstance(layer, int) else list(layer) if isinstance(layer, (list, tuple)) else None
    if not layers or not all(isinstance(i, int) and -(num_layers + 1) <= i <= num_layers for i in layers):
        raise ValueError(f"{where} has vision_feature_layer {layer!r}; it must be a hidden-state index (or a "
                         f"non-empty list of them) in {-(num_layers + 1)}..{num_layers}, the tower having "
                         f"{num_layers} layers")
    return tuple(i % (num_layers + 1) for i in layers)


# ---- the model ----


class PatchEmbedding(eqx.Module):
    patches: hnn.Linear
    """(channel, pixel_row, pixel_col) -> embed: the patch convolution; a bias with SigLIP."""
    class_token: hax.NamedArray | None
    """[embed], CLIP's; None for SigLIP."""
    position: hax.NamedArray
    """[position, embed]: one row per token of the tower."""
    pre_norm: hnn.LayerNorm | None
    """CLIP's `pre_layrnorm`; None for SigLIP."""
    grid: int = eqx.field(static=True)
    patch_size: int = eqx.field(static=True)

    def __call__(self, pixels: jax.Array) -> hax.NamedArray:
        """float [image, 3, H, W] -> hidden state 0 [image, position, embed]."""
        g, p = self.grid, self.patch_size
        dtype = self.position.dtype
        cut = pixels[:, :, : g * p, : g * p].astype(dtype).reshape(pixels.shape[0], pixels.shape[1], g, p, g, p)
        named = hax.named(cut, (Image, "channel", "patch_row", "pixel_row", "patch_col", "pixel_col"))
        x = hax.flatten_axes(self.patches(named), ("patch_row", "patch_col"), Pos)  # row-major, as conv+flatten
        x = x.rearrange((Image, Pos, "embed"))
        if self.class_token is not None:
            first = hax.broadcast_axis(self.class_token, (x.resolve_axis(Image), hax.Axis(Pos, 1)))
            x = hax.concatenate(Pos, [first.rearrange((Image, Pos, "embed")), x])
        x = x + self.position
        return x if self.pre_norm is None else layer_norm(self.pre_norm, x)


class Projector(eqx.Module):
    linear_1: hnn.Linear
    """(feature_layer, embed) -> projection: the concatenated hidden states in."""
    linear_2: hnn.Linear
    """projection -> text_embed."""
    act: str = eqx.field(static=True)

    def __call__(self, features: hax.NamedArray) -> hax.NamedArray:
        return self.linear_2(ACTIVATIONS[self.act](self.linear_1(features)))


class VisionModel(eqx.Module):
    embeddings: PatchEmbedding
    layers: tuple[EncoderLayer, ...]
    """The tower's first `config.depth` layers (pre-norm, the scores scaled after their float32 dot, no
    mask): none past the deepest selected hidden state."""
    projector: Projector
    config: VisionConfig = eqx.field(static=True)

    def hidden_states(self, pixels: jax.Array) -> hax.NamedArray:
        """pixels [image, 3, H, W] -> the selected hidden states [feature_layer, image, position, embed]."""
        states = [self.embeddings(pixels)]
        for layer in self.layers:
            states.append(layer(states[-1]))
        return hax.stack("feature_layer", [states[i] for i in self.config.feature_layers])


def image_features(model: VisionModel, pixels: jax.Array) -> jax.Array:
    """float [images, 3, image_size, image_size] (an `ImageProcessor`'s output) -> the decoder inputs that
    replace the images' placeholder tokens, [images, image_tokens(config), text_hidden] in the model dtype."""
    config = model.config
    if pixels.ndim != 4 or tuple(pixels.shape[1:]) != (3, config.image_size, config.image_size):
        raise ValueError(f"image_features takes pixels [images, 3, {config.image_size}, {config.image_size}], got "
                         f"{tuple(pixels.shape)}; preprocess with the checkpoint's preprocessor_config.json")
    features = model.hidden_states(pixels)
    if config.select_strategy == "default":
        features = features[Pos, 1:]
    return model.projector(features).rearrange((Image, Pos, "text_embed")).array


# ---- loading ----


def load_vision(model_dir: str | Path, dtype: str) -> VisionModel:
    """The vision tower (its first `depth` layers) and projector of a LLaVA checkpoint, in `dtype`
    ("float32" or "bfloat16")."""
    root = Path(model_dir).expanduser().absolute()
    config = read_vision_config(root)
    weights, axes = TorchWeights(_Tensors.read(root, config).tensor, jnp.dtype(dtype)), _Axes.of(config)
    layers = tuple(load_encoder_layer(weights, _layer_keys(i), config, pre_norm=True, scale_query=False)
                   for i in range(config.depth))
    model = VisionModel(_patch_embedding(weights, axes, config), layers, _projector(weights, axes, config), config)
    logger.info("loaded LLaVA %s vision tower %s (%d of %d layers, hidden %d, %d tokens per image, %s)", config.tower,
                root, config.depth, config.num_layers, config.hidden_size, image_tokens(config), dtype)
    return model


@dataclasses.dataclass(frozen=True)
class _Tensors:
    """The tower's and projector's tensors, named as `_vision_key` names them."""

    root: Path
    layout: Layout
    state: dict[str, np.ndarray]

    @staticmethod
    def read(root: Path, config: VisionConfig) -> _Tensors:
        layout = Layout.of(root)
        state = read_tensors(root, lambda key: _vision_key(key, layout, config.depth) is not None)
        return _Tensors(root, layout, {_vision_key(key, layout, config.depth): value for key, value in state.items()})

    def tensor(self, name: str) -> np.ndarray:
        if name not in self.state:
            raise ValueError(f"{self.root} has no weight {name!r} (under {self.layout.vision!r} / "
                             f"{self.layout.projector!r}): an incomplete or non-LLaVA checkpoint")
        return self.state[name]


def _layer_keys(i: int) -> LayerKeys:
    """Where CLIP's and SigLIP's encoders keep layer i's weights."""
    p = f"tower.encoder.layers.{i}"
    return LayerKeys(query=f"{p}.self_attn.q_proj", key=f"{p}.self_attn.k_proj", value=f"{p}.self_attn.v_proj",
                     out=f"{p}.self_attn.out_proj", attn_norm=f"{p}.layer_norm1", up=f"{p}.mlp.fc1",
                     down=f"{p}.mlp.fc2", mlp_norm=f"{p}.layer_norm2")


def _patch_embedding(w: TorchWeights, axes: _Axes, config: VisionConfig) -> PatchEmbedding:
    clip = config.class_token
    conv = w.tensor("tower.embeddings.patch_embedding.weight").transpose(1, 2, 3, 0)  # (out, c, h, w) -> (c, h, w, out)
    return PatchEmbedding(
        patches=w.linear("tower.embeddings.patch_embedding", (axes.channel, axes.pixel_row, axes.pixel_col),
                         axes.embed, weight=conv, bias=not clip),
        class_token=w.array("tower.embeddings.class_embedding", (axes.embed,)) if clip else None,
        position=w.array("tower.embeddings.position_embedding.weight", (axes.positions, axes.embed)),
        pre_norm=w.norm("tower.pre_layrnorm", axes.embed, config.layer_norm_eps) if clip else None,
        grid=config.grid,
        patch_size=config.patch_size,
    )


def _projector(w: TorchWeights, axes: _Axes, config: VisionConfig) -> Projector:
    return Projector(
        linear_1=w.linear("projector.linear_1", (axes.feature_layer, axes.embed), axes.projection,
                          bias=config.projector_bias),
        linear_2=w.linear("projector.linear_2", axes.projection, axes.text_embed, bias=config.projector_bias),
        act=config.projector_act,
    )


def _vision_key(key: str, layout: Layout, depth: int) -> str | None:
    """A checkpoint key as load_vision names it ("tower.…", "projector.…"), or None for a weight it does
    not need: the decoder's, the post-layernorm, SigLIP's pooling head, the layers past `depth`."""
    if key.startswith(layout.projector):
        return "projector." + key.removeprefix(layout.projector)
    if not key.startswith(layout.vision):
        return None
    name = key.removeprefix(layout.vision)
    layer = re.match(r"encoder\.layers\.(\d+)\.", name)
    if name.startswith(("post_layernorm.", "head.")) or (layer is not None and int(layer.group(1)) >= depth):
        return None
    return "tower." + name


@dataclasses.dataclass(frozen=True)
class _Axes:
    channel: hax.Axis
    pixel_row: hax.Axis
    pixel_col: hax.Axis
    positions: hax.Axis
    embed: hax.Axis
    feature_layer: hax.Axis
    projection: hax.Axis
    text_embed: hax.Axis

    @staticmethod
    def of(config: VisionConfig) -> _Axes:
        return _Axes(hax.Axis("channel", 3), hax.Axis("pixel_row", config.patch_size),
                     hax.Axis("pixel_col", config.patch_size), hax.Axis(Pos, config.positions),
                     LayerAxes.of(config).embed, hax.Axis("feature_layer", len(config.feature_layers)),
                     hax.Axis("projection", config.text_hidden_size), hax.Axis("text_embed", config.text_hidden_size))
