"""The vision side of a LLaVA-1.5-style model in haliax + equinox: images to the decoder's embeddings.

Reads a Hugging Face `LlavaForConditionalGeneration` checkpoint directory: config.json
(model_type "llava": `vision_config`, `text_config`, `vision_feature_layer`,
`vision_feature_select_strategy`, `image_token_index`/`image_token_id`, `projector_hidden_act`,
`multimodal_projector_bias`) and safetensors weights, one file or shards with
model.safetensors.index.json, under either key layout: transformers >= 4.52's in-memory names
(`model.vision_tower.vision_model.…`, `model.multi_modal_projector.…`, `model.language_model.…`,
`lm_head.weight`) or the older ones that transformers 4 still writes
(`vision_tower.vision_model.…`, `multi_modal_projector.…`, `language_model.model.…`,
`language_model.lm_head.weight`).

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

`language_model_files` hands the decoder's config and weights, under the plain causal-LM names, to
the engine's Llama/Qwen2/Mistral loader.
"""

from __future__ import annotations

import dataclasses
import json
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

logger = logging.getLogger(__name__)

Image, Pos, KPos = "image", "position", "key_position"
_TOWERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
"""vision_config.model_type -> the tower's kind."""
_TEXT_MODELS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
"""text_config.model_type -> its causal-LM class: the decoders whose weights are `model.*` + `lm_head`."""
_ACTIVATIONS: dict[str, Callable[[hax.NamedArray], hax.NamedArray]] = {
    "gelu": lambda x: hnn.gelu(x, approximate=False),
    "gelu_new": lambda x: hnn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: hnn.gelu(x, approximate=True),
    "quick_gelu": hnn.quick_gelu,
}
"""transformers' activation names (ACT2FN) served: `gelu` is erf's GELU, the two tanh ones are equal."""
_STRATEGIES = ("default", "full")
_LLAVA_DEFAULT_VISION = {"model_type": "clip_vision_model", "intermediate_size": 4096, "hidden_size": 1024,
                         "patch_size": 14, "image_size": 336, "num_hidden_layers": 24, "num_attention_heads": 16}
"""The tower `LlavaConfig` assumes when config.json has no vision_config (CLIP ViT-L/14 at 336 px)."""


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
    """The weights' dtype as config.json declares it (see `loading.declared_dtype`)."""

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
    from engine.models.loading import declared_dtype

    root = _root(model_dir)
    hf, vision, text = _llava_configs(root)
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
        tower=_TOWERS[vision["model_type"]],
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


def _llava_configs(root: Path) -> tuple[dict, dict, dict]:
    """(config.json, its vision_config, its text_config), the sub-configs with every field filled as
    transformers' config classes fill them (LlavaConfig's defaults for what is missing)."""
    from engine.formats.transformers_files import hf_config
    from engine.models.loading import read_hf_config

    hf = read_hf_config(root)
    if hf.get("model_type") != "llava":
        raise ValueError(f"model_type {hf.get('model_type')!r} in {root}/config.json is not a LLaVA-1.5-style "
                         "model; the vision encoder reads model_type 'llava' (LlavaForConditionalGeneration)")
    vision = {"model_type": "clip_vision_model", **(hf.get("vision_config") or _LLAVA_DEFAULT_VISION)}
    if vision["model_type"] not in _TOWERS:
        raise ValueError(f"{root}/config.json has vision_config.model_type {vision['model_type']!r}; the engine "
                         f"runs {' and '.join(_TOWERS)} towers")
    text = hf_config({"model_type": "llama", **(hf.get("text_config") or {})})
    if text["model_type"] not in _TEXT_MODELS:
        raise ValueError(f"{root}/config.json has text_config.model_type {text['model_type']!r}; the engine runs "
                         f"LLaVA over {', '.join(_TEXT_MODELS)} decoders")
    return hf, _filled(vision), _filled(text)


def _filled(sub_config: dict) -> dict:
    from transformers import AutoConfig

    kwargs = {k: v for k, v in sub_config.items() if k not in ("architectures", "transformers_version")}
    return AutoConfig.for_model(**kwargs).to_dict()


def _root(model_dir: str | Path) -> Path:
    return Path(model_dir).expanduser().absolute()


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
    root = _root(model_dir)
    config = read_vision_config(root)
    layout = _Layout.of(root)
    state = _read_tensors(root, lambda key: _vision_key(key, layout, config.depth) is not None)
    state = {_vision_key(key, layout, config.depth): value for key, value in state.items()}
    dt, axes = jnp.dtype(dtype), _Axes.of(config)

    def tensor(name: str) -> np.ndarray:
        if name not in state:
            raise ValueError(f"{root} has no weight {name!r} (under {layout.vision!r} / {layout.projector!r}): "
                             "an incomplete or non-LLaVA checkpoint")
        return state[name]

    def array(name: str, names: tuple) -> hax.NamedArray:
        return hax.named(jnp.asarray(tensor(name), dt), names)

    def linear(prefix: str, In, Out, weight: np.ndarray | None = None, bias: bool = True) -> hnn.Linear:
        in_shape = tuple(a.size for a in _spec(In))
        out_shape = tuple(a.size for a in _spec(Out))
        weight = tensor(f"{prefix}.weight").T if weight is None else weight  # torch keeps (out, in)
        named = hax.named(jnp.asarray(weight.reshape(in_shape + out_shape), dt), (*_spec(In), *_spec(Out)))
        b = hax.named(jnp.asarray(tensor(f"{prefix}.bias").reshape(out_shape), dt), _spec(Out)) if bias else None
        return hnn.Linear(named, b, In, Out)

    def norm(prefix: str) -> hnn.LayerNorm:
        return hnn.LayerNorm(axes.embed, array(f"{prefix}.weight", (axes.embed,)),
                             array(f"{prefix}.bias", (axes.embed,)), eps=config.layer_norm_eps)

    def layer(i: int) -> VisionLayer:
        p = f"tower.encoder.layers.{i}"
        qkv = [f"{p}.self_attn.{n}_proj" for n in ("q", "k", "v")]
        state[f"{p}.qkv.weight"] = np.concatenate([tensor(f"{n}.weight") for n in qkv], axis=0)
        state[f"{p}.qkv.bias"] = np.concatenate([tensor(f"{n}.bias") for n in qkv], axis=0)
        return VisionLayer(
            attn_norm=norm(f"{p}.layer_norm1"),
            qkv=linear(f"{p}.qkv", axes.embed, (axes.qkv, axes.heads, axes.head_size)),
            attn_out=linear(f"{p}.self_attn.out_proj", (axes.heads, axes.head_size), axes.embed),
            mlp_norm=norm(f"{p}.layer_norm2"),
            up=linear(f"{p}.mlp.fc1", axes.embed, axes.mlp),
            down=linear(f"{p}.mlp.fc2", axes.mlp, axes.embed),
            act=config.hidden_act,
        )

    clip = config.class_token
    conv = tensor("tower.embeddings.patch_embedding.weight").transpose(1, 2, 3, 0)  # (out, c, h, w) -> (c, h, w, out)
    embeddings = PatchEmbedding(
        patches=linear("tower.embeddings.patch_embedding", (axes.channel, axes.pixel_row, axes.pixel_col),
                       axes.embed, weight=conv, bias=not clip),
        class_token=array("tower.embeddings.class_embedding", (axes.embed,)) if clip else None,
        position=array("tower.embeddings.position_embedding.weight", (axes.positions, axes.embed)),
        pre_norm=norm("tower.pre_layrnorm") if clip else None,
        grid=config.grid,
        patch_size=config.patch_size,
    )
    projector = Projector(
        linear_1=linear("projector.linear_1", (axes.feature_layer, axes.embed), axes.projection,
                        bias=config.projector_bias),
        linear_2=linear("projector.linear_2", axes.projection, axes.text_embed, bias=config.projector_bias),
        act=config.projector_act,
    )
    model = VisionModel(embeddings, tuple(layer(i) for i in range(config.depth)), projector, config)
    logger.info("loaded LLaVA %s vision tower %s (%d of %d layers, hidden %d, %d tokens per image, %s)", config.tower,
                root, config.depth, config.num_layers, config.hidden_size, image_tokens(config), dtype)
    return model


def _vision_key(key: str, layout: _Layout, depth: int) -> str | None:
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


# ---- the decoder's files ----


def language_model_files(model_dir: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(the decoder's config.json dict, its state dict) as a plain causal LM's checkpoint would hold them.

    The config is text_config with every field filled as transformers fills it, `architectures` the
    causal-LM class and `torch_dtype` the checkpoint's. The state dict is named "model.embed_tokens.weight",
    "model.layers.0.…", "model.norm.weight", "lm_head.weight"; with tie_word_embeddings, lm_head.weight
    is the embedding matrix itself (transformers ties them whatever the file holds).
    """
    root = _root(model_dir)
    hf, _, text = _llava_configs(root)
    layout = _Layout.of(root)
    state = _read_tensors(root, lambda key: key.startswith(layout.language) or key == layout.lm_head)
    state = {("lm_head.weight" if key == layout.lm_head else "model." + key.removeprefix(layout.language)): value
             for key, value in state.items()}
    if "model.embed_tokens.weight" not in state:
        raise ValueError(f"{root} has no {layout.language}embed_tokens.weight: not a LLaVA checkpoint's decoder")
    if text.get("tie_word_embeddings"):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    elif "lm_head.weight" not in state:
        raise ValueError(f"{root} has no {layout.lm_head} and its text_config does not tie it to the embeddings")
    declared = hf.get("torch_dtype") or hf.get("dtype") or text.get("torch_dtype") or text.get("dtype") or "float32"
    text.pop("dtype", None)
    text.update(architectures=[_TEXT_MODELS[text["model_type"]]], torch_dtype=str(declared).removeprefix("torch."))
    return text, state


# ---- the files ----


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where a LlavaForConditionalGeneration checkpoint keeps its parts: the key prefixes."""

    vision: str
    """Of the tower's `vision_model` (embeddings, pre_layrnorm, encoder, ...)."""
    projector: str
    language: str
    """Of the decoder's base model (embed_tokens, layers, norm)."""
    lm_head: str
    """The LM head's weight's full key."""

    @staticmethod
    def of(root: Path) -> _Layout:
        keys = _tensor_names(root)
        if any(k.startswith("model.vision_tower.") for k in keys):  # transformers >= 4.52's names
            return _Layout("model.vision_tower.vision_model.", "model.multi_modal_projector.",
                           "model.language_model.", "lm_head.weight")
        if any(k.startswith("vision_tower.") for k in keys):  # earlier ones (llava-hf/llava-1.5-7b-hf)
            return _Layout("vision_tower.vision_model.", "multi_modal_projector.", "language_model.model.",
                           "language_model.lm_head.weight")
        raise ValueError(f"{root} has no vision_tower weights (model.vision_tower.* or vision_tower.*): not a "
                         "LlavaForConditionalGeneration checkpoint")


def _weight_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return sorted({root / name for name in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root} has no *.safetensors weights; the engine reads safetensors only (convert "
                         "pytorch_model.bin with transformers: from_pretrained, then save_pretrained)")
    return files


def _tensor_names(root: Path) -> set[str]:
    from safetensors import safe_open

    index = root / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for file in _weight_files(root):
        with safe_open(str(file), framework="np") as f:
            names.update(f.keys())
    return names


def _read_tensors(root: Path, keep: Callable[[str], bool]) -> dict[str, np.ndarray]:
    """The tensors whose key `keep` accepts, read from the shards that hold them (nothing else is read)."""
    import ml_dtypes  # noqa: F401  (registers numpy's bfloat16, which safetensors' numpy reader needs)
    from safetensors import safe_open

    state: dict[str, np.ndarray] = {}
    for file in _weight_files(root):
        with safe_open(str(file), framework="np") as f:
            state.update((key, f.get_tensor(key)) for key in filter(keep, f.keys()))
    return state
