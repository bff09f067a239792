"""gpt-oss (engine.models.decoder's `gpt_oss`): its MoE block (biased router, top-k then softmax,
biased experts, clamped SwiGLU) against transformers' GptOssMLP, MXFP4 experts (engine.layers.mxfp4)
against numpy, and tiny gpt-oss checkpoints, float and MXFP4, through the engine against
transformers (sinks, sliding layers, YaRN) on every backend."""

from __future__ import annotations

import functools

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.formats.checkpoint_quantization import CheckpointQuantization, read_quantization
from engine.generate.engine import LLMEngine
from engine.layers.moe import MoE, Routing, dispatch, dispatch_tiled
from engine.layers.mxfp4 import E2M1, Mxfp4MoELinear, dequantized
from tests.support import mxfp4_checkpoints
from tests.support.parity import TIGHT, assert_greedy_parity

Pos, Embed, Experts, Mlp = hax.Axis("position", 7), hax.Axis("embed", 64), hax.Axis("experts", 4), hax.Axis(
    "expert_mlp", 32)


def gpt_oss_moe(key) -> MoE:
    """A gpt-oss MoE block with random weights and biases (biases are zero at init)."""
    moe = MoE.init(Embed, Experts, Mlp, Routing(2, after_top_k=True), hnn.silu, key=key, router_bias=True,
                   biases=True, swiglu_limit=7.0)
    keys = jax.random.split(jax.random.fold_in(key, 1), 4)
    biases = tuple(hax.random.normal(k, b.axes) for k, b in zip(keys, moe.experts.biases))
    moe = jax.tree_util.tree_map(lambda x: x * 3, moe)  # weights large enough for gate and up to pass the clamp
    return eqx.tree_at(lambda m: (m.experts.biases, m.gate.bias), moe,
                       (biases, hax.random.normal(keys[3], moe.gate.bias.axes)))


def torch_mlp(moe: MoE):
    """transformers' GptOssMLP holding `moe`'s weights: the experts' gate and up interleaved into one
    [experts, in, 2 x mlp] tensor (gate at even columns), as the checkpoint stores them."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(hidden_size=Embed.size, num_local_experts=Experts.size, num_experts_per_tok=2,
                          intermediate_size=Mlp.size)
    mlp = GptOssMLP(config)
    array = lambda named, *axes: np.asarray(named.rearrange(axes).array)  # noqa: E731
    experts = moe.experts
    gate_up = np.zeros((Experts.size, Embed.size, 2 * Mlp.size), np.float32)
    gate_up[..., 0::2] = array(experts.gate_proj.weight, Experts, Embed, Mlp)
    gate_up[..., 1::2] = array(experts.up_proj.weight, Experts, Embed, Mlp)
    gate_up_bias = np.zeros((Experts.size, 2 * Mlp.size), np.float32)
    gate_up_bias[:, 0::2], gate_up_bias[:, 1::2] = (array(b, Experts, Mlp) for b in experts.biases[:2])
    with torch.no_grad():
        mlp.router.weight.copy_(torch.tensor(array(moe.gate.weight, Experts.alias("expert_scores"), Embed)))
        mlp.router.bias.copy_(torch.tensor(array(moe.gate.bias, Experts.alias("expert_scores"))))
        mlp.experts.gate_up_proj.copy_(torch.tensor(gate_up))
        mlp.experts.gate_up_proj_bias.copy_(torch.tensor(gate_up_bias))
        mlp.experts.down_proj.copy_(torch.tensor(array(experts.down_proj.weight, Experts, Mlp, Embed)))
        mlp.experts.down_proj_bias.copy_(torch.tensor(array(experts.biases[2], Experts, Embed)))
    return mlp


@pytest.mark.parametrize("run", [dispatch, dispatch_tiled, functools.partial(dispatch_tiled, tile=2)],
                         ids=["grouped", "tiled-8", "tiled-2"])
def test_a_gpt_oss_block_computes_what_transformers_gpt_oss_mlp_does(run):
    """Router logits with their bias, the top 2 softmaxed alone, each expert's biases, the SwiGLU
    clamped at 7 (the weights scaled so that gate and up pass the clamp)."""
    moe = gpt_oss_moe(jax.random.PRNGKey(0))
    x = hax.random.normal(jax.random.PRNGKey(2), (Pos, Embed))
    weights, chosen = moe.routing.choose(moe.gate(x))
    got = run(x, weights, chosen, moe.experts)
    want, _ = torch_mlp(moe)(torch.tensor(np.asarray(x.array))[None])
    np.testing.assert_allclose(np.asarray(got.array), want[0].detach().numpy(), rtol=1e-4, atol=1e-4)
    gate = np.asarray(x.array) @ np.asarray(moe.experts.gate_proj.weight.rearrange((Experts, Embed, Mlp)).array[0])
    assert gate.max() > 7.0  # the clamp is reached


def test_mxfp4_bytes_widen_to_every_e2m1_value_times_their_power_of_two():
    """Every 4-bit code (low nibble first) and scales from 2^-10 to 2^5: the values transformers'
    `convert_moe_packed_tensors` computes."""
    codes = np.arange(16, dtype=np.uint8)
    blocks = np.stack([codes | (codes[::-1] << 4)] * 3).reshape(3, 1, 16)  # [rows, blocks, 16 bytes]
    scales = np.array([[117], [127], [132]], np.uint8)
    got = np.asarray(dequantized(jnp.asarray(blocks), jnp.asarray(scales), jnp.float32))
    lut = np.asarray(E2M1, np.float32)
    want = np.stack([lut[codes], lut[codes[::-1]]], axis=-1).reshape(1, 32) * np.exp2([[-10.0], [0.0], [5.0]])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, mxfp4_checkpoints.dequantized(blocks, scales))


def test_an_mxfp4_expert_stack_holds_half_a_byte_a_value_and_runs_each_expert_with_its_scales():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((Experts.size, Mlp.size, Embed.size)).astype(np.float32)  # [experts, out, in]
    blocks, scales = mxfp4_checkpoints.quantized(w)
    linear = Mxfp4MoELinear.like(hnn.MoELinear.init(Experts, Embed, Mlp, key=jax.random.PRNGKey(0), use_bias=False))
    linear = linear.loaded({"blocks": blocks, "scales": scales})
    assert linear.blocks.dtype == jnp.uint8 and linear.blocks.array.size == w.size // 2
    weights = mxfp4_checkpoints.dequantized(blocks, scales)  # [experts, out, in]
    rows = rng.standard_normal((5, Embed.size)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(linear.expert_product(jnp.int32(3), jnp.asarray(rows))),
                               rows @ weights[3].T, rtol=1e-5, atol=1e-5)
    Rows = hax.Axis("expert_rows", 5)
    sizes = hax.named(jnp.array([2, 0, 0, 3], jnp.int32), Experts)
    got = linear(hax.named(jnp.asarray(rows), (Rows, Embed)), sizes).rearrange((Rows, Mlp)).array
    want = np.concatenate([rows[:2] @ weights[0].T, rows[2:] @ weights[3].T])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_an_mxfp4_quantization_config_reads_as_its_experts_blocks():
    config = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "mlp.router", "lm_head"]}
    read = read_quantization({"quantization_config": config})
    assert read == CheckpointQuantization("mxfp4", (1, 32), "scales", tuple(config["modules_to_not_convert"]))
    assert read.quantizes("model.layers.3.mlp.experts.gate_proj") and not read.quantizes("model.layers.3.mlp.router")


@pytest.fixture(scope="module")
def gpt_oss_checkpoints(checkpoint_factory, tmp_path_factory):
    """(float checkpoint, its MXFP4 copy, the MXFP4 copy's float32 twin)."""
    model_dir = checkpoint_factory("gpt_oss")
    mxfp4, reference = mxfp4_checkpoints.make_mxfp4_checkpoint(model_dir, tmp_path_factory.mktemp("mxfp4") / "ckpt")
    return model_dir, mxfp4, reference


@pytest.mark.parametrize("backend,scan_layers", [("cpu", False), ("xla", True), ("tpu", False)])
def test_gpt_oss_answers_as_transformers(gpt_oss_checkpoints, backend, scan_layers):
    """Sinks on every head, even layers sliding over 16 tokens, YaRN, 4 experts (2 a token): greedy
    tokens and logprobs equal transformers', with queueing, chunking, preemption and prefix hits."""
    model_dir, _, _ = gpt_oss_checkpoints
    engine = LLMEngine(EngineConfig(model=str(model_dir), attention_backend=backend, scan_layers=scan_layers,
                                    **TIGHT))
    assert engine.executor.runner.model.first_layer.self_attn.sinks is not None
    assert_greedy_parity(engine, model_dir)


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_an_mxfp4_gpt_oss_answers_as_transformers_on_its_dequantized_experts(gpt_oss_checkpoints, backend):
    _, mxfp4, reference = gpt_oss_checkpoints
    engine = LLMEngine(EngineConfig(model=str(mxfp4), attention_backend=backend, **TIGHT))
    experts = engine.executor.runner.model.first_layer.mlp.experts
    assert isinstance(experts.down_proj, Mxfp4MoELinear) and experts.down_proj.blocks.dtype == jnp.uint8
    assert_greedy_parity(engine, reference)
