"""Making a runner's models on its devices: the served model, the draft model of speculative
decoding, a LLaVA checkpoint's vision tower, and the LoRA adapters' pool.

Nothing of a model as loaded outlives its loading: the KV pool is sized afterwards from the memory
the serving models leave. A model is made on the devices, each layer placed as it is made, or (with
quantization, where the host's CPU is not one of the devices: `weights_host`) on the host's CPU and
then placed, so the devices never hold a checkpoint's float weights beside quantized ones.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from engine.backends.base import AttentionBackend
from engine.config import EngineConfig
from engine.formats.checkpoint_config import ModelInfo, model_info, read_hf_config
from engine.formats.llava import VISION_LINK
from engine.formats.model_sources import resolve_model
from engine.generate.runner import sharding
from engine.layers import moe
from engine.layers.lora import LoraPool, LoraShape, load_slot
from engine.layers.quantize import quantize_model
from engine.layers.rope import Rope
from engine.models.loading import load_model
from engine.models.paged_model import ImageRows, ServingModel
from engine.models.variant import Variant
from engine.models.vision import VisionConfig, image_features, image_tokens, load_vision, read_vision_config
from engine.step.buckets import ShapeBuckets

logger = logging.getLogger(__name__)


class LoadedModel(NamedTuple):
    """A serving model on the devices, prepared by the attention backend."""

    model: ServingModel
    info: ModelInfo
    layout: sharding.TensorParallelLayout
    lora_shape: Optional[LoraShape]
    """The LoRA pool's sizes for this model (None: no `max_loras`, or a draft model)."""


class VisionTower(NamedTuple):
    """A LLaVA checkpoint's image inputs on the devices."""

    config: VisionConfig
    images: ImageRows
    """The empty pool of image features."""
    write: Callable[[ImageRows, jax.Array, jax.Array], ImageRows]
    """The program computing one image's features into a slot of the pool (it holds the tower and
    projector; donates the pool)."""


class LoraSlots(NamedTuple):
    """The LoRA adapters' pool on the devices and the program that loads one slot (donates the pool)."""

    pool: LoraPool
    load: Callable[[LoraPool, jax.Array, dict], LoraPool]
    shape: LoraShape


@dataclasses.dataclass(frozen=True)
class ModelLoader:
    """Loads a runner's models onto `mesh`, the served model split as `layout` says."""

    config: EngineConfig
    dtype: str
    mesh: Mesh
    layout: sharding.TensorParallelLayout
    backend: AttentionBackend
    buckets: ShapeBuckets
    """The step shapes the backend prepares the weights for."""
    scan_layers: bool

    @property
    def weights_host(self) -> Optional[jax.Device]:
        """The host CPU device that quantized weights are made on before they go to the devices
        (so loading never holds the checkpoint's float weights on them); None: the weights are made
        on the devices themselves (no quantization, or the devices are the host's)."""
        host = sharding.host_device() if self.config.quantization else None
        return None if host is None or host in self.mesh.devices.flat else host

    def load(self) -> LoadedModel:
        """The served model, made on the devices or on `weights_host` and then placed."""
        config, host, layout = self.config, self.weights_host, self.layout
        if host is None:
            context = self._on_devices(load_mapping(layout))
            place = functools.partial(sharding.place, layout=layout, mesh=self.mesh)
        else:
            context = sharding.mesh_context(Mesh(np.array([host]).reshape(1, 1), self.mesh.axis_names), {})
            place = functools.partial(sharding.to_mesh, layout=layout, mesh=self.mesh)
        with context, jax.default_device(host):  # None: JAX's default device
            model, info = load_model(config.model, self.dtype, layout.split_parts)
            serving = serving_model(model, config.model, info, layout, self.scan_layers, place, config.quantization)
        lora_shape = LoraShape.of(serving.first_layer, info.num_layers, config.max_loras,
                                  config.max_lora_rank) if config.max_loras else None
        if host is not None:
            logger.info("weights made %s on %s, then placed on the devices", config.quantization, host)
        with self._on_devices():
            return LoadedModel(self._prepared(serving), info, layout, lora_shape)

    def load_draft(self, served: ModelInfo) -> Optional[LoadedModel]:
        """The draft model of `speculative: {method: draft_model}`, made on the devices and prepared
        by the backend as the served model (of `served`'s vocabulary) is; None without one."""
        config = self.config
        if config.draft_model is None:
            return None
        path = str(resolve_model(config.draft_model))
        info = model_info(path)
        if info.vocab_size != served.vocab_size:
            raise ValueError(f"the draft model {config.draft_model} has a vocabulary of {info.vocab_size} "
                             f"tokens, the served model {served.vocab_size}: a draft must share its tokenizer")
        layout = sharding.plan_layout(info, config.tensor_parallel_size, config.expert_parallel_size)
        place = functools.partial(sharding.place, layout=layout, mesh=self.mesh)
        with self._on_devices(load_mapping(layout)):
            model, info = load_model(path, self.dtype, layout.split_parts)
            serving = serving_model(model, path, info, layout, self.scan_layers, place, config.quantization)
        with self._on_devices(layout.axis_mapping):
            draft = self._prepared(serving)
        logger.info("draft model %s: %d layers, %d guesses per row", path, info.num_layers, config.max_drafts)
        return LoadedModel(draft, info, layout, None)

    def load_vision(self, served: ModelInfo) -> Optional[VisionTower]:
        """The vision tower of a LLaVA checkpoint's text entry (its `vision` link,
        engine.formats.llava) and an empty pool of `image_slots` images for the served model
        (`served`); None for any other model."""
        source = Path(self.config.model) / VISION_LINK
        if not source.is_dir():
            return None
        vision_config = read_vision_config(source)
        tokens, slots = image_tokens(vision_config), self.config.image_slots
        replicated = sharding.replicated(self.mesh)
        with self._on_devices():
            tower = jax.device_put(load_vision(source, self.dtype), replicated)
            rows = jax.device_put(jnp.zeros((slots * tokens, served.hidden_size), self.dtype), replicated)
        logger.info("vision tower %s: %d tokens per image, %d image slots", vision_config.tower, tokens, slots)
        return VisionTower(vision_config, ImageRows(rows, served.vocab_size, tokens, slots), _write_program(tower))

    def lora_slots(self, shape: Optional[LoraShape]) -> Optional[LoraSlots]:
        """The empty pool of `shape.slots` adapters, split over the mesh as the weights it adapts;
        None without a shape."""
        if shape is None:
            return None
        with self._on_devices():
            pool = sharding.place(LoraPool.zeros(shape, jnp.dtype(self.dtype)), self.layout, self.mesh)
        shardings = jax.tree_util.tree_map(lambda a: a.sharding, pool)
        logger.info("LoRA: %d slots of rank %d for %s (%.1f MiB)", shape.slots, shape.rank,
                    ", ".join(shape.projections), sum(a.nbytes for a in jax.tree_util.tree_leaves(pool)) / 2**20)
        return LoraSlots(pool, jax.jit(load_slot, donate_argnums=(0,), out_shardings=shardings), shape)

    def _prepared(self, serving: ServingModel) -> ServingModel:
        """`serving` laid out for the backend, its experts run as suits the devices' platform."""
        prepared = self.backend.prepare(serving, self.buckets, measure=self.config.warmup)
        return moe.for_platform(prepared, self.backend.platform)

    def _on_devices(self, mapping: Optional[dict[str, str]] = None):
        return sharding.mesh_context(self.mesh, self.layout.axis_mapping if mapping is None else mapping)


def load_mapping(layout: sharding.TensorParallelLayout) -> dict[str, str]:
    """The axis mapping to load weights under: the layout's, but KV heads that are to be repeated
    load whole (they split only after repeating), and experts that split whole load with each
    expert's MLP split instead (levanter's Mixtral names that axis `mlp`, as the dense MLP's), then
    split whole when placed."""
    mapping = dict(layout.axis_mapping)
    if layout.kv_repeats > 1:
        mapping.pop("kv_head", None)
    if mapping.pop("experts", None):
        mapping["expert_mlp"] = sharding.MODEL_AXIS
    return mapping


def serving_model(model, model_dir: str, info: ModelInfo, layout: sharding.TensorParallelLayout, scan_layers: bool,
                  place=lambda tree: tree, quantization: Optional[str] = None) -> ServingModel:
    """The serving model a replica makes of a loaded levanter model (or its shapes): KV heads
    repeated as the layout needs, weights quantized as `quantization` says, the checkpoint's
    RoPE, the layers unrolled or stacked; `place` puts it (each unstacked layer as it is made) on
    its devices."""
    if layout.kv_repeats > 1:
        model = sharding.repeat_kv_heads(model, layout.kv_repeats)
    model = quantize_model(model, quantization)
    hf = read_hf_config(model_dir)
    rope, variant = Rope.from_hf_config(hf, info.head_dim), Variant.from_hf_config(hf, info.head_dim)
    return place(ServingModel.from_levanter(model, rope, scan_layers, place, variant))


def _write_program(tower) -> Callable[[ImageRows, jax.Array, jax.Array], ImageRows]:
    """f(images, slot, pixels f[1, 3, H, W]) -> images with the image's features in slot `slot`."""
    params, static = eqx.partition(tower, eqx.is_array)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def write(images: ImageRows, slot, pixels) -> ImageRows:
        features = image_features(eqx.combine(params, static), pixels)[0].astype(images.rows.dtype)
        return dataclasses.replace(images, rows=jax.lax.dynamic_update_slice(
            images.rows, features, (slot * images.tokens_per_image, 0)))

    return write
