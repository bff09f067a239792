"""Decoder families levanter does not define, assembled from its parts: Qwen3-MoE is levanter's Qwen3
(attention with q/k norms, RMS norms, embeddings, LM head) whose MLPs are mixtures of experts
(engine.layers.moe) on its sparse layers and dense SwiGLUs on the others.

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
from levanter.models.llama import LlamaMlp
from levanter.models.qwen import Qwen3Config, Qwen3LMHeadModel
from transformers import AutoConfig

from engine.layers.moe import EXPERT_MLP, EXPERTS, MoE, Routing

FAMILIES = ("qwen3_moe",)
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


def levanter_config(hf: dict) -> Qwen3Config:
    """levanter's Qwen3 config of a Qwen3-MoE config.json: everything but the experts."""
    kwargs = {k: v for k, v in hf.items() if k not in ("architectures", "transformers_version")}
    return Qwen3Config.from_hf_config(AutoConfig.for_model(**kwargs))


def init_model(hf: dict, Vocab: hax.Axis, *, key):
    """A Qwen3-MoE model of `hf`'s sizes with random weights (call under `eqx.filter_eval_shape`
    for the template `load` fills)."""
    config = levanter_config(hf)
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

    @hax.named_jit
    def filled(template, state_dict):
        return hax.shard(from_torch_compatible_state_dict(template, state_dict))

    return filled(template, state_dict)
