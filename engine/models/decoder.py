"""Decoder families levanter does not define, assembled from its parts:
- Qwen3-MoE: levanter's Qwen3 (attention with q/k norms, RMS norms, embeddings, LM head) whose MLPs
  are mixtures of experts (engine.layers.moe) on its sparse layers and dense SwiGLUs on the others;
- Phi-3 / 3.5 / 4-mini: levanter's Llama, its checkpoint's fused `qkv_proj` and `gate_up_proj`
  split into Llama's projections on load (its longrope and partial rotary embeddings are
  engine.layers.rope's, as every family's).

The model has levanter's LM-head shape (`transformer.layers`, `transformer.norm`, `embeddings`,
`lm_head`), so engine.models.paged_model runs it as any other, and is read from the checkpoint's
state dict by haliax's state-dict loader under the same names as transformers'. Layers that are
all alike are stacked (a scanned loop can run them); a model that mixes dense and sparse layers
keeps a sequence of layers (unrolled).
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
from haliax.jax_utils import shaped_rng_split
from haliax.nn.scan import BlockSeq, Stacked
from haliax.state_dict import ModuleWithStateDictSerialization, from_torch_compatible_state_dict
from levanter.layers.attention import Attention
from levanter.models.llama import LlamaConfig, LlamaLMHeadModel, LlamaMlp
from levanter.models.qwen import Qwen3Config, Qwen3LMHeadModel
from transformers import AutoConfig

from engine.layers.moe import EXPERT_MLP, EXPERTS, MoE, Routing

FAMILIES = ("qwen3_moe", "phi3")
"""config.json `model_type`s assembled here."""


class DecoderLayer(ModuleWithStateDictSerialization):
    """A pre-norm decoder layer (Llama's shape) whose MLP is dense or a mixture of experts."""

    self_attn: Attention
    mlp: eqx.Module
    input_layernorm: hnn.RmsNorm
    post_attention_layernorm: hnn.RmsNorm

    @staticmethod
    def init(config: Qwen3Config, sparse: bool, experts: dict, *, key) -> "DecoderLayer":
        """`experts`: `MoE.init`'s sizes and routing (used if `sparse`)."""
        k_attn, k_mlp = jax.random.split(key)
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
    kwargs = {k: v for k, v in hf.items() if k not in ("architectures", "transformers_version")}
    kwargs.update(rope_scaling=None, partial_rotary_factor=1.0)
    if hf["model_type"] == "phi3":
        return LlamaConfig.from_hf_config(AutoConfig.for_model(**{**kwargs, "model_type": "llama"}))
    return Qwen3Config.from_hf_config(AutoConfig.for_model(**kwargs))


def init_model(hf: dict, Vocab: hax.Axis, *, key):
    """A model of `hf`'s family and sizes with random weights (call under `eqx.filter_eval_shape`
    for the template `load` fills)."""
    config = levanter_config(hf)
    if hf["model_type"] == "phi3":
        return LlamaLMHeadModel.init(Vocab, config, key=key)
    experts = {"Experts": hax.Axis(EXPERTS, hf["num_experts"]),
               "Mlp": hax.Axis(EXPERT_MLP, hf["moe_intermediate_size"]),
               "routing": Routing(hf["num_experts_per_tok"], normalize=hf.get("norm_topk_prob", False))}
    k_model, k_layers = jax.random.split(key)
    model = Qwen3LMHeadModel.init(Vocab, config, key=k_model)
    sparse = sparse_layers(hf)
    keys = shaped_rng_split(k_layers, config.num_layers)
    if len(set(sparse)) == 1:
        layers = Stacked.init(config.Layers, DecoderLayer)(config, sparse[0], experts, key=keys)
    else:
        layers = BlockSeq([DecoderLayer.init(config, s, experts, key=k) for s, k in zip(sparse, keys)],
                          config.Layers, False)
    return eqx.tree_at(lambda m: m.transformer.layers, model, layers)


def load(hf: dict, Vocab: hax.Axis, state_dict: dict):
    """The model of `hf` with the checkpoint's `state_dict` (transformers' names), placed as the
    context's axis mapping splits it (call under the engine's mesh)."""
    template = eqx.filter_eval_shape(init_model, hf, Vocab, key=jax.random.PRNGKey(0))
    return filled(template, unfused(hf, state_dict))


@hax.named_jit
def filled(template, state_dict: dict):
    """`template` (shapes) filled from `state_dict` (transformers' names), placed as the context's
    axis mapping splits it."""
    return hax.shard(from_torch_compatible_state_dict(template, state_dict))


def unfused(hf: dict, state_dict: dict) -> dict:
    """Phi-3's state dict under Llama's names: each layer's `qkv_proj` rows split into q, k and v
    (heads x head_dim, then KV heads x head_dim twice), `gate_up_proj` into gate and up (halves,
    gate first, as transformers' Phi3MLP chunks them). Other families' as they are."""
    if hf["model_type"] != "phi3":
        return state_dict
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
