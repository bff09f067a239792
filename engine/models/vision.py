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
  * pre-norm layers of bidirectional self-attention and an MLP (CLIP: quick_gelu; SigLIP:
    gelu_pytorch_tanh); hidden state i is layer i's output. The post-layernorm (and SigLIP's
    pooling head) never reach LLaVA's features, so they are not loaded.
  * the hidden state `vision_feature_layer` picks (a list: those, concatenated on the embedding axis,
    in the list's order); "default" drops position 0 (CLIP's class token; with SigLIP, the first
    patch, as transformers does), "full" keeps every position.
  * the projector: linear_1, `projector_hidden_act`, linear_2, to the decoder's hidden size.
Only the layers up to the deepest selected hidden state are loaded and run.

Named axes: "image", "channel", "patch_row"/"patch_col" (which patch), "pixel_row"/"pixel_col"
(the pixel inside a patch), "position" (the tower's tokens; "key_position" inside attention),
"embed", "qkv", "heads", "head_size", "mlp", "feature_layer" (the selected hidden states),
"projection" (linear_1's output), "text_embed" (the decoder's hidden size). Weights are stored
(In..., Out...), as `loading.inputs_first` lays out the decoder's, so no call transposes a weight.
In bfloat16, the LayerNorm statistics and the softmax (and its scores) run in float32.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np

from engine.formats.checkpoint_config import declared_dtype
from engine.formats.llava import TOWERS, Layout, llava_configs, read_tensors

logger = logging.getLogger(__name__)

Image, Pos, KPos = "image", "position", "key_position"
_ACTIVATIONS: dict[str, Callable[[hax.NamedArray], hax.NamedArray]] = {
    "gelu": lambda x: hnn.gelu(x, approximate=False),
    "gelu_new": lambda x: hnn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: hnn.gelu(x, approximate=True),
    "quick_gelu": hnn.quick_gelu,
}
"""transformers' activation names (ACT2FN) served: `gelu` is erf's GELU, the two tanh ones are equal."""
_STRATEGIES = ("default", "full")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The sizes of a LLaVA vision tower and projector, from config.json (as transformers fills it)."""

    tower: str
    """"clip" or "siglip"."""
    hidden_size: int
    num_layers: int
    """The tower's layers; only `depth` of them run."""
    num_heads: int
    intermediate_size: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
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
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

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
        if act not in _ACTIVATIONS:
            raise ValueError(f"{where} has {field} {act!r}; the engine supports {', '.join(_ACTIVATIONS)}")
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
        return x if self.pre_norm is None else _layer_norm(self.pre_norm, x)


class VisionLayer(eqx.Module):
    attn_norm: hnn.LayerNorm
    qkv: hnn.Linear
    """embed -> (qkv, heads, head_size): query, key and value in one product."""
    attn_out: hnn.Linear
    mlp_norm: hnn.LayerNorm
    up: hnn.Linear
    down: hnn.Linear
    act: str = eqx.field(static=True)

    def __call__(self, x: hax.NamedArray) -> hax.NamedArray:
        """[image, position, embed] -> the same: pre-norm attention, then a pre-norm MLP, each residual."""
        x = x + self._attend(_layer_norm(self.attn_norm, x))
        return x + self.down(_ACTIVATIONS[self.act](self.up(_layer_norm(self.mlp_norm, x))))

    def _attend(self, x: hax.NamedArray) -> hax.NamedArray:
        qkv = self.qkv(x)
        q, k, v = (qkv["qkv", i] for i in range(3))
        k, v = k.rename({Pos: KPos}), v.rename({Pos: KPos})
        scale = 1.0 / np.sqrt(q.resolve_axis("head_size").size)
        scores = hax.dot(q, k, axis="head_size", preferred_element_type=jnp.float32) * scale
        weights = hnn.softmax(scores, axis=KPos).astype(v.dtype)
        return self.attn_out(hax.dot(weights, v, axis=KPos))


class Projector(eqx.Module):
    linear_1: hnn.Linear
    """(feature_layer, embed) -> projection: the concatenated hidden states in."""
    linear_2: hnn.Linear
    """projection -> text_embed."""
    act: str = eqx.field(static=True)

    def __call__(self, features: hax.NamedArray) -> hax.NamedArray:
        return self.linear_2(_ACTIVATIONS[self.act](self.linear_1(features)))


class VisionModel(eqx.Module):
    embeddings: PatchEmbedding
    layers: tuple[VisionLayer, ...]
    """The tower's first `config.depth` layers: none past the deepest selected hidden state."""
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


def _layer_norm(norm: hnn.LayerNorm, x: hax.NamedArray) -> hax.NamedArray:
    """`norm` with float32 statistics, returned in x's dtype."""
    return norm(x.astype(jnp.float32)).astype(x.dtype)


# ---- loading ----


def load_vision(model_dir: str | Path, dtype: str) -> VisionModel:
    """The vision tower (its first `depth` layers) and projector of a LLaVA checkpoint, in `dtype`
    ("float32" or "bfloat16")."""
    root = Path(model_dir).expanduser().absolute()
    config = read_vision_config(root)
    weights = _Weights.read(root, config, jnp.dtype(dtype))
    layers = tuple(_vision_layer(weights, config, i) for i in range(config.depth))
    model = VisionModel(_patch_embedding(weights, config), layers, _projector(weights, config), config)
    logger.info("loaded LLaVA %s vision tower %s (%d of %d layers, hidden %d, %d tokens per image, %s)", config.tower,
                root, config.depth, config.num_layers, config.hidden_size, image_tokens(config), dtype)
    return model


@dataclasses.dataclass
class _Weights:
    """The tower's and projector's tensors, named as `_vision_key` names them, made into haliax modules."""

    root: Path
    layout: Layout
    state: dict[str, np.ndarray]
    dtype: jnp.dtype
    axes: _Axes
    eps: float

    @staticmethod
    def read(root: Path, config: VisionConfig, dtype: jnp.dtype) -> _Weights:
        layout = Layout.of(root)
        state = read_tensors(root, lambda key: _vision_key(key, layout, config.depth) is not None)
        state = {_vision_key(key, layout, config.depth): value for key, value in state.items()}
        return _Weights(root, layout, state, dtype, _Axes.of(config), config.layer_norm_eps)

    def tensor(self, name: str) -> np.ndarray:
        if name not in self.state:
            raise ValueError(f"{self.root} has no weight {name!r} (under {self.layout.vision!r} / "
                             f"{self.layout.projector!r}): an incomplete or non-LLaVA checkpoint")
        return self.state[name]

    def array(self, name: str, names: tuple) -> hax.NamedArray:
        return hax.named(jnp.asarray(self.tensor(name), self.dtype), names)

    def linear(self, prefix: str, In, Out, weight: np.ndarray | None = None, bias: bool = True) -> hnn.Linear:
        in_shape = tuple(a.size for a in _spec(In))
        out_shape = tuple(a.size for a in _spec(Out))
        weight = self.tensor(f"{prefix}.weight").T if weight is None else weight  # torch keeps (out, in)
        named = hax.named(jnp.asarray(weight.reshape(in_shape + out_shape), self.dtype), (*_spec(In), *_spec(Out)))
        b = None
        if bias:
            b = hax.named(jnp.asarray(self.tensor(f"{prefix}.bias").reshape(out_shape), self.dtype), _spec(Out))
        return hnn.Linear(named, b, In, Out)

    def norm(self, prefix: str) -> hnn.LayerNorm:
        embed = self.axes.embed
        return hnn.LayerNorm(embed, self.array(f"{prefix}.weight", (embed,)), self.array(f"{prefix}.bias", (embed,)),
                             eps=self.eps)


def _vision_layer(w: _Weights, config: VisionConfig, i: int) -> VisionLayer:
    p, axes = f"tower.encoder.layers.{i}", w.axes
    qkv = [f"{p}.self_attn.{n}_proj" for n in ("q", "k", "v")]
    w.state[f"{p}.qkv.weight"] = np.concatenate([w.tensor(f"{n}.weight") for n in qkv], axis=0)
    w.state[f"{p}.qkv.bias"] = np.concatenate([w.tensor(f"{n}.bias") for n in qkv], axis=0)
    return VisionLayer(
        attn_norm=w.norm(f"{p}.layer_norm1"),
        qkv=w.linear(f"{p}.qkv", axes.embed, (axes.qkv, axes.heads, axes.head_size)),
        attn_out=w.linear(f"{p}.self_attn.out_proj", (axes.heads, axes.head_size), axes.embed),
        mlp_norm=w.norm(f"{p}.layer_norm2"),
        up=w.linear(f"{p}.mlp.fc1", axes.embed, axes.mlp),
        down=w.linear(f"{p}.mlp.fc2", axes.mlp, axes.embed),
        act=config.hidden_act,
    )


def _patch_embedding(w: _Weights, config: VisionConfig) -> PatchEmbedding:
    clip, axes = config.class_token, w.axes
    conv = w.tensor("tower.embeddings.patch_embedding.weight").transpose(1, 2, 3, 0)  # (out, c, h, w) -> (c, h, w, out)
    return PatchEmbedding(
        patches=w.linear("tower.embeddings.patch_embedding", (axes.channel, axes.pixel_row, axes.pixel_col),
                         axes.embed, weight=conv, bias=not clip),
        class_token=w.array("tower.embeddings.class_embedding", (axes.embed,)) if clip else None,
        position=w.array("tower.embeddings.position_embedding.weight", (axes.positions, axes.embed)),
        pre_norm=w.norm("tower.pre_layrnorm") if clip else None,
        grid=config.grid,
        patch_size=config.patch_size,
    )


def _projector(w: _Weights, config: VisionConfig) -> Projector:
    axes = w.axes
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
    qkv: hax.Axis
    heads: hax.Axis
    head_size: hax.Axis
    mlp: hax.Axis
    feature_layer: hax.Axis
    projection: hax.Axis
    text_embed: hax.Axis

    @staticmethod
    def of(config: VisionConfig) -> _Axes:
        return _Axes(hax.Axis("channel", 3), hax.Axis("pixel_row", config.patch_size),
                     hax.Axis("pixel_col", config.patch_size), hax.Axis(Pos, config.positions),
                     hax.Axis("embed", config.hidden_size), hax.Axis("qkv", 3), hax.Axis("heads", config.num_heads),
                     hax.Axis("head_size", config.head_size), hax.Axis("mlp", config.intermediate_size),
                     hax.Axis("feature_layer", len(config.feature_layers)),
                     hax.Axis("projection", config.text_hidden_size), hax.Axis("text_embed", config.text_hidden_size))


def _spec(axes) -> tuple[hax.Axis, ...]:
    return (axes,) if isinstance(axes, hax.Axis) else tuple(axes)
