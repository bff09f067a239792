"""Decoder families levanter does not define, assembled from its parts:
- Qwen3-MoE: levanter's Qwen3 (attention with q/k norms, RMS norms, embeddings, LM head) whose MLPs
  are mixtures of experts (engine.layers.moe) on its sparse layers and dense SwiGLUs on the others;
- Phi-3 / 3.5 / 4-mini: levanter's Llama, its checkpoint's fused `qkv_proj` and `gate_up_proj`
  split into Llama's projections on load (its longrope and partial rotary embeddings are
  engine.layers.rope's, as every family's).
- DeepSeek-V3 / R1 (`deepseek_v3`): levanter's Llama embeddings, norms and LM head around layers of
  multi-head latent attention (engine.layers.latent_attention) and, after `first_k_dense_replace`
  dense layers, mixtures of experts with sigmoid, group-limited routing and a shared MLP; its
  multi-token-prediction layers (past `num_hidden_layers`) are not loaded.
- gpt-oss: levanter's Llama with biased attention projections and learned sinks
  (engine.layers.sink_attention), every MLP a mixture of experts with a biased router (top-k
  logits, then a softmax over them), biased experts and the clamped SwiGLU; the checkpoint's fused
  and interleaved gate/up tensors split on load (`prepared`), MXFP4 experts kept as they are.

The model has levanter's LM-head shape (`transformer.layers`, `transformer.norm`, `embeddings`,
`lm_head`), so engine.models.paged_model runs it as any other, and is read from the checkpoint's
state dict by haliax's state-dict loader under the same names as transformers'. Layers that are
all alike are stacked (a scanned loop can run them); a model that mixes dense and sparse layers
keeps a sequence of layers (unrolled).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import numpy as np
from haliax.jax_utils import shaped_rng_split
from haliax.nn.scan import BlockSeq, Stacked
from haliax.state_dict import ModuleWithStateDictSerialization, from_torch_compatible_state_dict
from levanter.layers.attention import Attention
from levanter.models.llama import LlamaConfig, LlamaLMHeadModel, LlamaMlp
from levanter.models.qwen import Qwen3Config, Qwen3LMHeadModel
from transformers import AutoConfig

from engine.layers.latent_attention import LatentAttention, LatentSizes
from engine.layers.moe import EXPERT_MLP, EXPERTS, MoE, Routing
from engine.layers.sink_attention import SinkAttention

FAMILIES = ("qwen3_moe", "phi3", "gpt_oss", "deepseek_v3")
"""config.json `model_type`s assembled here."""


class DecoderLayer(ModuleWithStateDictSerialization):
    """A pre-norm decoder layer (Llama's shape) whose MLP is dense or a mixture of experts."""

    self_attn: Attention
    mlp: eqx.Module
    input_layernorm: hnn.RmsNorm
    post_attention_layernorm: hnn.RmsNorm

    @staticmethod
    def init(config: Qwen3Config, sparse: bool, experts: dict, *, key, attention: str = "levanter",
             latent: Optional[LatentSizes] = None) -> "DecoderLayer":
        """`experts`: `MoE.init`'s sizes and routing (used if `sparse`); `attention`: levanter's,
        gpt-oss's "sinks" (biased projections, learned sinks) or DeepSeek's "latent" (of `latent`'s sizes)."""
        k_attn, k_mlp = jax.random.split(key)
        if attention == "sinks":
            attention = SinkAttention.init(dataclasses.replace(config.attention_config(), use_bias=True), key=k_attn)
        elif attention == "latent":
            attention = LatentAttention.init(config.Embed, latent, key=k_attn)
        else:
            attention = Attention.init(config.attention_config(), key=k_attn)
        if sparse:
            mlp = MoE.init(config.Embed, act=config.activation_function.to_fn(), key=k_mlp, **experts)
        else:
            mlp = LlamaMlp.init(config.Embed, config.Mlp, config.activation_function, key=k_mlp,
                                use_bias=config.use_bias)
        return DecoderLayer(attention, mlp, config.mk_LayerNorm(config.Embed), config.mk_LayerNorm(config.Embed))


def sparse_layers(hf: dict) -> list[bool]:
    """Which layers are mixtures of experts, as transformers' Qwen3-MoE decides: those not in
    `mlp_only_layers` whose number (from 1) is a multiple of `decoder_sparse_step`."""
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    return [i not in dense and hf.get("num_experts", 0) > 0 and (i + 1) % step == 0
            for i in range(hf["num_hidden_layers"])]


def levanter_config(hf: dict):
    """levanter's config of the family's base (Qwen3 for Qwen3-MoE: everything but the experts;
    Llama for Phi-3); the RoPE is engine.layers.rope's, so levanter's is left default."""
    kwargs = {k: v for k, v in hf.items() if k not in ("architectures", "transformers_version", "layer_types")}
    kwargs.update(rope_scaling=None, partial_rotary_factor=1.0)
    if hf["model_type"] in ("phi3", "gpt_oss", "deepseek_v3"):  # attention biases are the layers' own, not the norms'
        llama = {**kwargs, "model_type": "llama", "attention_bias": False, "mlp_bias": False}
        config = LlamaConfig.from_hf_config(AutoConfig.for_model(**llama))
        return dataclasses.replace(config, head_dim=hf.get("head_dim"))  # levanter's reader drops it
    return Qwen3Config.from_hf_config(AutoConfig.for_model(**kwargs))


def init_model(hf: dict, Vocab: hax.Axis, *, key):
    """A model of `hf`'s family and sizes with random weights (call under `eqx.filter_eval_shape`
    for the template `load` fills)."""
    config, family = levanter_config(hf), hf["model_type"]
    if family == "phi3":
        return LlamaLMHeadModel.init(Vocab, config, key=key)
    k_model, k_layers = jax.random.split(key)
    base = Qwen3LMHeadModel if family == "qwen3_moe" else LlamaLMHeadModel
    model, (sparse, experts, attention) = base.init(Vocab, config, key=k_model), _layers(hf)
    keys = shaped_rng_split(k_layers, config.num_layers)
    kwargs = {"attention": attention, "latent": latent_sizes(hf) if attention == "latent" else None}
    if len(set(sparse)) == 1:
        layers = Stacked.init(config.Layers, DecoderLayer)(config, sparse[0], experts, key=keys, **kwargs)
    else:
        layers = BlockSeq([DecoderLayer.init(config, s, experts, key=k, **kwargs) for s, k in zip(sparse, keys)],
                          config.Layers, False)
    return eqx.tree_at(lambda m: m.transformer.layers, model, layers)


def _layers(hf: dict) -> tuple[list[bool], dict, str]:
    """(which layers are mixtures of experts, `MoE.init`'s options, the attention) of a family with experts."""
    family, layers = hf["model_type"], hf["num_hidden_layers"]
    if family == "gpt_oss":
        return [True] * layers, {
            "Experts": hax.Axis(EXPERTS, hf["num_local_experts"]), "Mlp": hax.Axis(EXPERT_MLP, hf["intermediate_size"]),
            "routing": Routing(hf["num_experts_per_tok"], after_top_k=True), "router_bias": True, "biases": True,
            "swiglu_limit": hf.get("swiglu_limit", 7.0)}, "sinks"
    if family == "deepseek_v3":
        dense = hf.get("first_k_dense_replace", 0)
        routing = Routing(hf["num_experts_per_tok"], normalize=hf.get("norm_topk_prob", True), scoring="sigmoid",
                          n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                          scaling=hf.get("routed_scaling_factor", 1.0))
        return [i >= dense for i in range(layers)], {
            "Experts": hax.Axis(EXPERTS, hf["n_routed_experts"]),
            "Mlp": hax.Axis(EXPERT_MLP, hf["moe_intermediate_size"]), "routing": routing, "correction_bias": True,
            "shared_mlp": hf["moe_intermediate_size"] * (hf.get("n_shared_experts") or 0)}, "latent"
    return sparse_layers(hf), {
        "Experts": hax.Axis(EXPERTS, hf["num_experts"]), "Mlp": hax.Axis(EXPERT_MLP, hf["moe_intermediate_size"]),
        "routing": Routing(hf["num_experts_per_tok"], normalize=hf.get("norm_topk_prob", False))}, "levanter"


def latent_sizes(hf: dict) -> LatentSizes:
    """DeepSeek's attention sizes and softmax scale (YaRN's mscale squared where `mscale_all_dim` says)."""
    scaling = (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]) ** -0.5
    rope = hf.get("rope_scaling") or {}
    if rope.get("mscale_all_dim") and rope.get("factor", 1.0) > 1:
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0
        scaling *= mscale * mscale
    return LatentSizes(hf["num_attention_heads"], hf.get("q_lora_rank"), hf["kv_lora_rank"], hf["qk_nope_head_dim"],
                       hf["qk_rope_head_dim"], hf["v_head_dim"], scaling, hf.get("rms_norm_eps", 1e-6),
                       bool(hf.get("attention_bias")))


def load(hf: dict, Vocab: hax.Axis, state_dict: dict):
    """The model of `hf` with the checkpoint's `state_dict` (transformers' names), placed as the
    context's axis mapping splits it (call under the engine's mesh)."""
    template = eqx.filter_eval_shape(init_model, hf, Vocab, key=jax.random.PRNGKey(0))
    return filled(template, prepared(hf, state_dict))


@hax.named_jit
def filled(template, state_dict: dict):
    """`template` (shapes) filled from `state_dict` (transformers' names), placed as the context's
    axis mapping splits it."""
    return hax.shard(from_torch_compatible_state_dict(template, state_dict))


def model_layers(hf: dict, state_dict: dict) -> dict:
    """The state dict without the layers numbered from `num_hidden_layers` on (DeepSeek's
    multi-token-prediction layers), which the model does not run."""
    layers = hf["num_hidden_layers"]

    def extra(name: str) -> bool:
        parts = name.split(".")
        return len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= layers

    return {name: array for name, array in state_dict.items() if not extra(name)}


def prepared(hf: dict, state_dict: dict) -> dict:
    """The checkpoint's state dict under the names (and in the shapes) the family's modules read
    (`model_layers` only): Phi-3's, gpt-oss's and DeepSeek's rearranged (`_phi3`, `_gpt_oss`,
    `_deepseek`), other families' as they are."""
    state_dict = model_layers(hf, state_dict)
    if hf["model_type"] == "phi3":
        return _phi3(hf, state_dict)
    if hf["model_type"] == "gpt_oss":
        return _gpt_oss(hf, state_dict)
    if hf["model_type"] == "deepseek_v3":
        return _deepseek(hf, state_dict)
    return state_dict


def _deepseek(hf: dict, state_dict: dict) -> dict:
    """DeepSeek's state dict with, where `rope_interleave` (the default), each RoPE part's dimensions
    reordered from interleaved pairs to halves (evens then odds, as transformers reorders them before
    rotating): the rows of q_b_proj (q_proj) and kv_a_proj_with_mqa that make them (a block-scaled
    FP8 weight's RoPE rows lie within one block of rows, so its scales are unchanged); kv_b_proj's
    weight by head (an FP8 one is widened before: it is read as a float weight)."""
    rope, nope = hf["qk_rope_head_dim"], hf["qk_nope_head_dim"]
    halves = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
    out = {}
    for name, array in state_dict.items():
        parts = name.split(".")
        if hf.get("rope_interleave", True) and parts[-1] == "weight" and parts[-2] in ("q_b_proj", "q_proj"):
            head = nope + rope
            rows = np.arange(array.shape[0]).reshape(-1, head)
            array = array[np.concatenate([rows[:, :nope], rows[:, nope:][:, halves]], axis=1).reshape(-1)]
        elif hf.get("rope_interleave", True) and parts[-2] == "kv_a_proj_with_mqa" and parts[-1] in ("weight", "bias"):
            latent = hf["kv_lora_rank"]
            array = array[np.concatenate([np.arange(latent), latent + halves])]
        elif parts[-2:] == ["kv_b_proj", "weight"]:  # (heads, nope + v, latent): LatentAttention's absorbed weight
            array = array.reshape(hf["num_attention_heads"], -1, array.shape[-1])
        out[name] = array
    return out


def _gpt_oss(hf: dict, state_dict: dict) -> dict:
    """gpt-oss's state dict: each layer's `sinks` [heads] as (kv_head, q_heads_per_group); the router
    `mlp.router` as `mlp.gate`; the experts' fused `gate_up_proj` [experts, in, 2 x mlp] (gate and up
    interleaved: gate at even columns) and `down_proj` [experts, mlp, out] as `gate_proj`, `up_proj`,
    `down_proj` [experts, out, in], their biases split alike; MXFP4 experts' `_blocks` / `_scales`
    (rows are outputs, interleaved alike) split by row."""
    groups = hf["num_attention_heads"] // hf["num_key_value_heads"]
    out = {}
    for name, array in state_dict.items():
        stem, _, leaf = name.rpartition(".")
        if leaf == "sinks":
            out[name] = array.reshape(*array.shape[:-1], -1, groups)
        elif stem.endswith("mlp.router"):
            out[f"{stem.removesuffix('router')}gate.{leaf}"] = array
        elif stem.endswith("mlp.experts"):
            out.update(_gpt_oss_experts(stem, leaf, array))
        else:
            out[name] = array
    return out


def _gpt_oss_experts(stem: str, leaf: str, array) -> dict:
    """One of gpt-oss's expert tensors under ExpertMlps' names (see `_gpt_oss`)."""
    if leaf in ("gate_up_proj", "down_proj"):  # [..., in, out]
        array = array.swapaxes(-1, -2)
    if leaf.startswith("down_proj"):
        kind = {"down_proj": "weight", "down_proj_bias": "bias", "down_proj_blocks": "blocks",
                "down_proj_scales": "scales"}[leaf]
        return {f"{stem}.down_proj.{kind}": array}
    kind = {"gate_up_proj": "weight", "gate_up_proj_bias": "bias", "gate_up_proj_blocks": "blocks",
            "gate_up_proj_scales": "scales"}[leaf]
    rows = -1 if kind == "bias" else {"weight": -2, "blocks": -3, "scales": -2}[kind]  # the output axis
    index = [slice(None)] * array.ndim
    gate, up = list(index), list(index)
    gate[rows], up[rows] = slice(0, None, 2), slice(1, None, 2)
    return {f"{stem}.gate_proj.{kind}": array[tuple(gate)], f"{stem}.up_proj.{kind}": array[tuple(up)]}


def _phi3(hf: dict, state_dict: dict) -> dict:
    """Phi-3's state dict under Llama's names: each layer's `qkv_proj` rows split into q, k and v
    (heads x head_dim, then KV heads x head_dim twice), `gate_up_proj` into gate and up (halves,
    gate first, as transformers' Phi3MLP chunks them)."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    q_rows = hf["num_attention_heads"] * head_dim
    kv_rows = (hf.get("num_key_value_heads") or hf["num_attention_heads"]) * head_dim
    out = {}
    for name, array in state_dict.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            out[base + "q_proj.weight"] = array[:q_rows]
            out[base + "k_proj.weight"] = array[q_rows:q_rows + kv_rows]
            out[base + "v_proj.weight"] = array[q_rows + kv_rows:]
        elif name.endswith("mlp.gate_up_proj.weight"):
            base, half = name.removesuffix("gate_up_proj.weight"), array.shape[0] // 2
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = array[:half], array[half:]
        else:
            out[name] = array
    return out
