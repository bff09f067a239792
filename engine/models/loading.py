"""Loading local Hugging Face checkpoints into levanter models, one entry per model family.

A family is a (config.json `model_type`, levanter config class) pair; levanter's HF converter reads
the safetensors weights. The families levanter does not define are assembled from its parts
(engine.models.decoder) and filled from the same state dict. A mixture of experts runs as
engine.layers.moe's, whichever built it. Loading happens under the engine's device mesh (levanter
needs one) from a local directory (engine.formats.model_sources fetched it): the path is made
absolute so it is never mistaken for a Hub repo id.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Optional

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
from levanter.compat.hf_checkpoints import HFCheckpointConverter
from levanter.models.gemma import Gemma2Config, Gemma3Config
from levanter.models.llama import LlamaConfig
from levanter.models.mistral import MistralConfig
from levanter.models.mixtral import MixtralConfig, MixtralSparseMoeBlock
from levanter.models.olmo import Olmo2Config
from levanter.models.qwen import Qwen3Config, QwenConfig
from transformers import AutoConfig

from engine.formats.checkpoint_config import ModelInfo, model_info, read_hf_config
from engine.formats.checkpoint_quantization import CheckpointQuantization, read_quantization
from engine.formats.safetensors_files import read_checkpoint
from engine.formats.transformers_files import load_tokenizer
from engine.layers.fp8 import FP8, dequantize_host, is_fp8
from engine.layers.moe import MoE, from_levanter_mixtral
from engine.layers.quantized_template import with_quantized_layers
from engine.models import decoder

logger = logging.getLogger(__name__)

_FAMILIES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": QwenConfig, "qwen3": Qwen3Config,
             "olmo2": Olmo2Config, "mixtral": MixtralConfig, "gemma2": Gemma2Config, "gemma3_text": Gemma3Config,
             "qwen3_moe": Qwen3Config, "phi3": LlamaConfig, "gpt_oss": LlamaConfig, "deepseek_v3": LlamaConfig}
"""levanter's config class of each family that engine.formats.checkpoint_config.SUPPORTED_FAMILIES names
(for those engine.models.decoder assembles: the one its state dict is read with)."""


def resolve_dtype(dtype: str, info: ModelInfo) -> str:
    """The dtype to serve in: `auto` is the checkpoint's own (engine.formats.checkpoint_config.declared_dtype)."""
    return info.dtype if dtype == "auto" else dtype


def load_model(model_dir: str | Path, dtype: str, parts: Optional[dict[str, int]] = None):
    """Load the levanter LM-head model for `model_dir` in `dtype` ("float32" or "bfloat16"); a
    checkpoint's FP8 weights stay FP8 (engine.layers.fp8), their scales laid out for a split of
    each axis into `parts[axis]` (the serving layout's `split_parts`).

    Call under the engine's mesh and axis mapping (`haliax.partitioning.set_mesh`,
    `haliax.axis_mapping`): levanter places the weights as the mapping splits them.
    """
    path = str(Path(model_dir).expanduser().absolute())
    info = model_info(path)
    hf_config = read_hf_config(path)
    quantization = read_quantization(hf_config)
    if quantization is not None:
        model = _load_quantized(path, info, hf_config, quantization, parts)
    else:
        model = _load_float(path, info, hf_config, dtype)
    model = _serving_layout(model, jnp.dtype(dtype))
    logger.info("loaded %s checkpoint %s (%d layers, %s%s)", info.family, path, info.num_layers, dtype,
                "" if quantization is None else f", {quantization.method} weights kept quantized")
    return model, info


def _load_float(path: str, info: ModelInfo, hf_config: dict, dtype: str):
    """The model of a float checkpoint, read by levanter's converter: through levanter's own model
    of the family, or filled into engine.models.decoder's."""
    converter = HFCheckpointConverter(_FAMILIES[info.family], reference_checkpoint=path,
                                      tokenizer=load_tokenizer(path))
    if info.family in decoder.FAMILIES:
        Vocab = hax.Axis("vocab", info.vocab_size)
        return decoder.load(hf_config, Vocab, converter.load_state_dict(path, jnp.dtype(dtype)))
    if info.family == "qwen2":
        load = converter.load_state_dict
        object.__setattr__(converter, "load_state_dict",
                           lambda ref=None, dtype=None: _with_qwen2_biases(load(ref, dtype), hf_config))
    lev_config = _levanter_config(info, hf_config)
    return converter.load_pretrained(lev_config.model_type, ref=path, config=lev_config,
                                     resize_vocab_to_match_tokenizer=False, dtype=jnp.dtype(dtype))


def _load_quantized(path: str, info: ModelInfo, hf_config: dict, quantization: CheckpointQuantization,
                    parts: Optional[dict[str, int]]):
    """The model of a quantized checkpoint, read by engine.formats.safetensors_files (levanter's reader
    refuses its dtypes): each layer the checkpoint holds in FP8 or MXFP4 stays so
    (engine.layers.quantized_template), but an FP8 router's weight, which is widened to float here.
    Layers the model does not run are dropped first (no host work is spent on them)."""
    tensors = decoder.model_layers(hf_config, read_checkpoint(path))
    if quantization.method == "mxfp4":
        tensors = decoder.prepared(hf_config, tensors)
        held = {name.removesuffix(".blocks") for name in tensors if name.endswith(".blocks")}
    else:
        held = {name.removesuffix(".weight") for name, array in tensors.items()
                if name.endswith(".weight") and array.dtype == FP8}
    Vocab = hax.Axis("vocab", info.vocab_size)
    names: set[str] = set()

    def build():
        model, quantized = with_quantized_layers(_template(info, hf_config, Vocab), quantization, held.__contains__,
                                                 parts)
        names.update(quantized)
        return model

    template = eqx.filter_eval_shape(build)
    if quantization.method != "mxfp4":
        for name in held - names:
            scale = tensors[f"{name}.{quantization.scale_name}"]
            tensors[f"{name}.weight"] = dequantize_host(tensors[f"{name}.weight"], scale, quantization.block)
        tensors = decoder.prepared(hf_config, tensors)
    if info.family == "qwen2":
        tensors = _with_qwen2_biases(tensors, hf_config)
    return decoder.filled(template, tensors)


def abstract_model(model_dir: str | Path, dtype: str, transform=lambda model: model,
                   parts: Optional[dict[str, int]] = None):
    """(`transform` of the levanter model `load_model` would load, as shapes and dtypes only,
    ModelInfo): built from config.json alone (no weights, no tokenizer, no memory), for planning
    and ahead-of-time compiling. Its arrays are jax.ShapeDtypeStructs; FP8 weights are those
    the checkpoint's quantization_config names (`parts`: as `load_model`'s)."""
    info, hf_config = model_info(model_dir), read_hf_config(model_dir)
    quantization = read_quantization(hf_config)
    Vocab = hax.Axis("vocab", info.vocab_size)

    def build():
        model = _template(info, hf_config, Vocab)
        if quantization is not None:
            model, _ = with_quantized_layers(model, quantization, quantization.quantizes, parts)
        return transform(inputs_first(cast_floating(model, jnp.dtype(dtype))))

    return eqx.filter_eval_shape(build), info


def _template(info: ModelInfo, hf_config: dict, Vocab: hax.Axis):
    """A model of the checkpoint's family and sizes with random weights, its MoEs engine.layers.moe's
    (call under `eqx.filter_eval_shape`)."""
    if info.family in decoder.FAMILIES:
        return decoder.init_model(hf_config, Vocab, key=jax.random.PRNGKey(0))
    lev_config = _levanter_config(info, hf_config)
    return own_moe(lev_config.model_type.init(Vocab, lev_config, key=jax.random.PRNGKey(0)))


def _levanter_config(info: ModelInfo, hf_config: dict):
    """The levanter config of the checkpoint's family, from its config.json (as `read_hf_config` reads it)."""
    if info.family == "qwen2":  # levanter's Qwen2 reader takes biases from `no_bias`
        hf_config = {"no_bias": False, **hf_config}
    family, hf = _FAMILIES[info.family], AutoConfig.for_model(**_hf_kwargs(hf_config))
    if info.family == "gemma3_text":  # levanter's Gemma3Config.from_hf_config lacks its @classmethod
        return family.from_hf_config(family, hf)
    return family.from_hf_config(hf)


def _with_qwen2_biases(state: dict, hf_config: dict) -> dict:
    """HF Qwen2 has biases on q/k/v only; levanter's Qwen2 puts one on every linear and norm. Zero
    biases for the others make the two the same function."""
    hidden, inter = hf_config["hidden_size"], hf_config["intermediate_size"]
    shapes = {"mlp.gate_proj": inter, "mlp.up_proj": inter, "mlp.down_proj": hidden, "self_attn.o_proj": hidden,
              "input_layernorm": hidden, "post_attention_layernorm": hidden}
    dtype = np.asarray(state["model.norm.weight"]).dtype
    for layer in range(hf_config["num_hidden_layers"]):
        for name, size in shapes.items():
            state.setdefault(f"model.layers.{layer}.{name}.bias", np.zeros(size, dtype))
    state.setdefault("model.norm.bias", np.zeros(hidden, dtype))
    return state


def _serving_layout(model, dtype):
    """The loaded model in `dtype` (levanter keeps a bf16 checkpoint in bf16), `own_moe` and
    `inputs_first`: one program for all weights, which takes the loaded arrays (donated: nothing else holds them)."""
    @functools.partial(eqx.filter_jit, donate="all")
    def relaid(model):
        return inputs_first(cast_floating(own_moe(model), dtype))

    return relaid(model)


def own_moe(model):
    """`model` with levanter's Mixtral MoE blocks as engine.layers.moe's (the same arrays)."""
    return jax.tree_util.tree_map(lambda m: from_levanter_mixtral(m) if isinstance(m, MixtralSparseMoeBlock) else m,
                                  model, is_leaf=lambda m: isinstance(m, MixtralSparseMoeBlock))


def inputs_first(model):
    """Lay every linear weight out as (..., In, Out): the contracting axes major, as XLA's dot wants
    its right operand, so no step transposes (copies) a weight. Named axes keep the math unchanged."""
    def relayout(module):
        if not isinstance(module, hnn.Linear):
            return module
        names = lambda spec: [a.name for a in ((spec,) if isinstance(spec, hax.Axis) else spec)]  # noqa: E731
        order = (..., *names(module.In), *names(module.Out))
        return dataclasses.replace(module, weight=module.weight.rearrange(order))

    return jax.tree_util.tree_map(relayout, model, is_leaf=lambda x: isinstance(x, hnn.Linear))


def cast_floating(model, dtype):
    """Cast every floating-point weight of `model` to `dtype`, but FP8 weights and their scales, and a
    MoE's routing correction bias (DeepSeek's, float32 as its reference keeps it: it decides choices)."""
    def kept(leaf) -> bool:
        return is_fp8(leaf) or isinstance(leaf, (hax.NamedArray, MoE))

    def cast(leaf):
        if is_fp8(leaf):
            return leaf if leaf.bias is None else dataclasses.replace(leaf, bias=cast(leaf.bias))
        if isinstance(leaf, MoE):
            rest = dataclasses.replace(leaf, correction_bias=None)
            rest = jax.tree_util.tree_map(cast, rest, is_leaf=lambda x: x is not rest and kept(x))
            return dataclasses.replace(rest, correction_bias=leaf.correction_bias)
        if isinstance(leaf, hax.NamedArray):
            return hax.named(cast(leaf.array), leaf.axes)
        if eqx.is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype != dtype:
            return leaf.astype(dtype)
        return leaf

    return jax.tree_util.tree_map(cast, model, is_leaf=kept)


def _hf_kwargs(hf_config: dict) -> dict:
    return {k: v for k, v in hf_config.items() if k not in ("architectures", "transformers_version")}
