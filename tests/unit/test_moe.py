"""engine.layers.moe against transformers' MoE blocks (Qwen3-MoE's; DeepSeek-V3's with its grouped
sigmoid routing, correction bias and shared MLP), and Qwen3-MoE checkpoints through the engine
(engine.models.decoder): greedy tokens and logprobs equal transformers', dense and sparse layers
mixed, on every backend."""

from __future__ import annotations

import dataclasses
import functools

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from engine.backends.cpu import kernels as cpu_kernels
from engine.backends.cpu.packed_experts import PackedExperts
from engine.config import EngineConfig
from engine.formats.checkpoint_config import ModelInfo
from engine.generate.engine import LLMEngine
from engine.generate.runner.sharding import plan_experts, plan_layout
from engine.layers.moe import EXPERT_MLP, MoE, Routing, dispatch, dispatch_tiled, for_platform
from engine.layers.quantize import Int8Linear, Int8MoELinear, quantize_model
from engine.models.decoder import sparse_layers
from tests.support.parity import TIGHT, assert_greedy_parity

Pos, Embed, Experts, Mlp = hax.Axis("position", 7), hax.Axis("embed", 16), hax.Axis("experts", 5), hax.Axis("mlp", 12)


def torch_block(moe: MoE, norm_topk_prob: bool):
    """transformers' Qwen3-MoE block holding `moe`'s weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=Embed.size, num_experts=Experts.size, num_experts_per_tok=moe.routing.top_k,
                            moe_intermediate_size=Mlp.size, norm_topk_prob=norm_topk_prob, hidden_act="silu")
    block = Qwen3MoeSparseMoeBlock(config)
    tensor = lambda named, *axes: torch.tensor(np.asarray(named.rearrange(axes).array))  # noqa: E731
    with torch.no_grad():
        block.gate.weight.copy_(tensor(moe.gate.weight, Experts.alias("expert_scores"), Embed))
        for i, expert in enumerate(block.experts):
            expert.gate_proj.weight.copy_(tensor(moe.experts.gate_proj.weight, Experts, Mlp, Embed)[i])
            expert.up_proj.weight.copy_(tensor(moe.experts.up_proj.weight, Experts, Mlp, Embed)[i])
            expert.down_proj.weight.copy_(tensor(moe.experts.down_proj.weight, Experts, Embed, Mlp)[i])
    return block


@pytest.mark.parametrize("normalize", [True, False])
def test_a_block_computes_what_transformers_qwen3_moe_block_does(normalize):
    moe = MoE.init(Embed, Experts, Mlp, Routing(2, normalize), hnn.silu, key=jax.random.PRNGKey(0))
    x = hax.random.normal(jax.random.PRNGKey(1), (Pos, Embed))
    want, _ = torch_block(moe, normalize)(torch.tensor(np.asarray(x.array))[None])
    np.testing.assert_allclose(np.asarray(moe(x).array), want[0].detach().numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("run", [dispatch, dispatch_tiled, functools.partial(dispatch_tiled, tile=2)],
                         ids=["grouped", "tiled-8", "tiled-2"])
def test_dispatch_sums_each_tokens_chosen_experts_with_its_weights(run):
    """Tokens that share an expert, an expert no token chose, a token that chose one expert twice
    (weights 0.25 + 0.75), and choices of experts held on other devices (5 and 9: past this
    device's 5) that add nothing: each token gets Σ weight · expert(x) over its choices held here.
    Tiles of 2 rows: experts 0 and 3 fill more than one."""
    moe = MoE.init(Embed, Experts, Mlp, Routing(2), hnn.silu, key=jax.random.PRNGKey(2))
    x = hax.random.normal(jax.random.PRNGKey(3), (Pos, Embed))
    Top = hax.Axis("top_experts", 2)
    chosen = hax.named(jnp.array([[0, 3], [3, 0], [1, 1], [4, 0], [0, 5], [9, 3], [3, 4]], jnp.int32), (Pos, Top))
    weights = hax.named(jax.random.uniform(jax.random.PRNGKey(4), (Pos.size, 2)).at[2].set(jnp.array([0.25, 0.75])),
                        (Pos, Top))

    def expert(e: int, row):
        if e >= Experts.size:
            return jnp.zeros_like(row)
        w = lambda linear: linear.weight.rearrange((Experts, linear.In, linear.Out)).array[e]  # noqa: E731
        return (jax.nn.silu(row @ w(moe.experts.gate_proj)) * (row @ w(moe.experts.up_proj))) @ w(moe.experts.down_proj)

    want = [sum(weights.array[t, k] * expert(int(chosen.array[t, k]), x.array[t]) for k in range(2))
            for t in range(Pos.size)]
    got = jax.jit(run)(x, weights, chosen, moe.experts)
    assert got.axes == (Pos, Embed)
    np.testing.assert_allclose(np.asarray(got.array), np.stack(want), rtol=1e-5, atol=1e-5)


def test_on_cpus_bfloat16_experts_are_held_as_bits_and_run_tile_by_tile():
    """`for_platform(.., "cpu")`: the expert weights' bfloat16 bits (uint16, the same bytes), widened
    one expert at a time inside the loop; the output equals the grouped products' on the bfloat16
    weights widened to float32 (the router keeps its dtype)."""
    moe = MoE.init(Embed, Experts, Mlp, Routing(2), hnn.silu, key=jax.random.PRNGKey(5))
    moe = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16) if isinstance(a, jax.Array) else a, moe)
    x = hax.random.normal(jax.random.PRNGKey(6), (Pos, Embed))
    on_cpu = for_platform(moe, "cpu")
    assert on_cpu.tiled and on_cpu.experts.gate_proj.weight.dtype == jnp.uint16
    on_tpu = for_platform(moe, "tpu")
    assert on_cpu.gate.weight.dtype == on_tpu.experts.gate_proj.weight.dtype == jnp.bfloat16 and not on_tpu.tiled
    widened = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32) if isinstance(a, jax.Array) else a, moe)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda m, x: m(x))(on_cpu, x).array),
                               np.asarray(widened(x).array), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs the cpu kernels")
@pytest.mark.parametrize("mlp", [16, 12])
def test_packed_experts_run_grouped_on_the_kernel_or_tile_by_tile_beside_unpacked_ones(mlp):
    """The cpu backend's expert stacks (PackedExperts): with every projection packed (an MLP of 16,
    whole panels) the MoE dispatches grouped, each projection one kernel call; where the gate and up
    projections cannot be packed (an MLP of 12) it runs tile by tile, the packed down projection read
    expert by expert from its stack. Either way the output is the grouped products' on the same
    bfloat16 weights widened to float32."""
    Wide = Mlp.resize(mlp)
    moe = MoE.init(Embed, Experts, Wide, Routing(2), hnn.silu, key=jax.random.PRNGKey(7))
    moe = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16) if isinstance(a, jax.Array) else a, moe)
    x = hax.random.normal(jax.random.PRNGKey(8), (Pos, Embed))
    pack = lambda m: PackedExperts.from_moe_linear(m, jnp.bfloat16) if PackedExperts.packable(m) else m  # noqa: E731
    packed = jax.tree_util.tree_map(pack, moe, is_leaf=lambda m: isinstance(m, hnn.MoELinear))
    on_cpu = for_platform(packed, "cpu")
    assert isinstance(on_cpu.experts.down_proj, PackedExperts)
    assert on_cpu.tiled == (mlp == 12) and isinstance(on_cpu.experts.gate_proj, PackedExperts) == (mlp == 16)
    widened = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32) if isinstance(a, jax.Array) else a, moe)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda m, x: m(x))(on_cpu, x).array),
                               np.asarray(widened(x).array), rtol=1e-5, atol=1e-5)


Tokens, DsExperts, ExpertMlp = hax.Axis("position", 24), hax.Axis("experts", 16), hax.Axis(EXPERT_MLP, 12)
DEEPSEEK = {"num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}


def deepseek_routing(normalize: bool, **changes) -> Routing:
    options = {"n_group": DEEPSEEK["n_group"], "topk_group": DEEPSEEK["topk_group"],
               "scaling": DEEPSEEK["routed_scaling_factor"], **changes}
    return Routing(DEEPSEEK["num_experts_per_tok"], normalize, scoring="sigmoid", **options)


def deepseek_pair(normalize: bool):
    """transformers' DeepseekV3MoE (16 experts in 4 groups, 3 a token from the 2 best groups, a
    shared MLP twice an expert's width) with random weights and a random correction bias, and a
    `MoE` filled from its state dict (transformers' names)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(hidden_size=Embed.size, n_routed_experts=DsExperts.size,
                              moe_intermediate_size=ExpertMlp.size,
                              n_shared_experts=2, norm_topk_prob=normalize, hidden_act="silu", **DEEPSEEK)
    torch.manual_seed(0)
    block = DeepseekV3MoE(config)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0, 0.5)
        block.gate.e_score_correction_bias.uniform_(0, 0.4)  # biased scores stay > 0: no ties with masked ones
    template = MoE.init(Embed, DsExperts, ExpertMlp, deepseek_routing(normalize), hnn.silu,
                        key=jax.random.PRNGKey(0), correction_bias=True, shared_mlp=2 * ExpertMlp.size)
    state = {name: tensor.numpy() for name, tensor in block.state_dict().items()}
    return block, hax.state_dict.from_torch_compatible_state_dict(template, state)


def torch_tokens(x) -> torch.Tensor:
    return torch.tensor(np.asarray(x.array))


@pytest.mark.parametrize("normalize", [True, False])
def test_a_deepseek_v3_block_chooses_the_experts_and_weights_transformers_does(normalize):
    """Each token's 3 experts (as a set) and their weights equal transformers' router's, and the
    correction bias changes some tokens' choices (so it is applied, and only for choosing)."""
    block, moe = deepseek_pair(normalize)
    x = hax.random.normal(jax.random.PRNGKey(1), (Tokens, Embed))
    assert moe.correction_bias.array.min() > 0 and moe.shared.gate_proj.Out.size == 2 * ExpertMlp.size
    want_experts, want_weights = (t.detach().numpy() for t in block.gate(torch_tokens(x)))
    weights, chosen = moe.route(x)
    order, want_order = np.argsort(np.asarray(chosen.array), axis=1), np.argsort(want_experts, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(chosen.array), order, 1),
                                  np.take_along_axis(want_experts, want_order, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights.array), order, 1),
                               np.take_along_axis(want_weights, want_order, 1), rtol=1e-6, atol=1e-6)
    _, unbiased = moe.routing.choose(moe.gate(x))
    assert (np.sort(np.asarray(unbiased.array), 1) != np.sort(np.asarray(chosen.array), 1)).any(axis=1).sum() >= 3


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("run", ["grouped", "tiled-8", "tiled-2"])
def test_a_deepseek_v3_block_computes_what_transformers_does(normalize, run):
    """The routed experts' weighted sum plus the shared MLP, through the grouped products and the
    CPU tile loop (tiles of 8 rows, and of 2: experts over several tiles)."""
    block, moe = deepseek_pair(normalize)
    x = hax.random.normal(jax.random.PRNGKey(1), (Tokens, Embed))
    want = block(torch_tokens(x)[None])[0].detach().numpy()
    if run == "tiled-2":
        block_fn = lambda m, x: dispatch_tiled(x, *m.route(x), m.experts, tile=2) + m.shared(x)  # noqa: E731
    else:
        moe, block_fn = dataclasses.replace(moe, tiled=run == "tiled-8"), lambda m, x: m(x)  # noqa: E731
    got = jax.jit(block_fn)(moe, x)
    assert got.axes == (Tokens, Embed)
    np.testing.assert_allclose(np.asarray(got.array), want, rtol=1e-5, atol=1e-5)


def test_deepseek_v3_groups_limit_each_tokens_experts_to_its_best_groups():
    """8 experts in 4 groups of 2, 2 a token from the 2 best groups. Scores (sigmoid of the logits)
    [0.95, 0.05 | 0.6, 0.58 | 0.56, 0.55 | 0.1, 0.12]: group 0's sum (1.0) is below groups 1 and 2
    (1.18, 1.11), so expert 0, the best alone, is out: experts 2 and 3, weighted 0.6 / 1.18 and
    0.58 / 1.18 times 2.5, as transformers' router chooses; without groups, experts 0 and 2."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    scores = np.array([[0.95, 0.05, 0.6, 0.58, 0.56, 0.55, 0.1, 0.12]], np.float32)
    logits = np.log(scores / (1 - scores))
    config = DeepseekV3Config(hidden_size=8, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                              norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(8))
    want_experts, want_weights = (t.detach().numpy() for t in router(torch.tensor(logits)))
    named = hax.named(jnp.asarray(logits), (hax.Axis("position", 1), hax.Axis("expert_scores", 8)))
    routing = Routing(2, True, scoring="sigmoid", n_group=4, topk_group=2, scaling=2.5)
    weights, chosen = routing.choose(named)
    order = np.argsort(np.asarray(chosen.array[0]))
    assert np.asarray(chosen.array[0])[order].tolist() == sorted(want_experts[0].tolist()) == [2, 3]
    np.testing.assert_allclose(np.asarray(weights.array[0])[order], [2.5 * 0.6 / 1.18, 2.5 * 0.58 / 1.18], rtol=1e-5)
    np.testing.assert_allclose(np.sort(want_weights[0]), np.sort(np.asarray(weights.array[0])), rtol=1e-6)
    _, ungrouped = dataclasses.replace(routing, n_group=1, topk_group=1).choose(named)
    assert sorted(np.asarray(ungrouped.array[0]).tolist()) == [0, 2]


def test_a_routing_that_cannot_be_made_is_refused_with_what_to_change():
    with pytest.raises(ValueError, match=r"topk_group must be between 1 and n_group \(4\), got 5"):
        Routing(2, scoring="sigmoid", n_group=4, topk_group=5)
    with pytest.raises(ValueError, match="expert groups \\(n_group=4\\) are supported with scoring 'sigmoid' only"):
        Routing(2, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="needs Routing\\(scoring='sigmoid'\\)"):
        MoE.init(Embed, DsExperts, Mlp, Routing(2), hnn.silu, key=jax.random.PRNGKey(0), correction_bias=True)
    with pytest.raises(ValueError, match="n_group=4 must split the router's 6 experts into equal groups of at least 2"):
        Routing(2, scoring="sigmoid", n_group=4, topk_group=2).choose(hax.zeros(hax.Axis("expert_scores", 6)))


class _Layer(eqx.Module):
    """The least of a model `quantize_model` takes: its layers and no token embedding."""

    mlp: MoE
    embeddings: None = None


def test_int8_keeps_a_deepseek_routers_weights_and_bias_float_and_quantizes_its_experts_and_shared_mlp():
    """The router's weight and correction bias unchanged (float32), the experts and the shared MLP
    int8; the block then computes what the float block does on the weights int8 holds."""
    _, moe = deepseek_pair(True)
    quantized = quantize_model(_Layer(moe), "int8").mlp
    assert isinstance(quantized.gate, hnn.Linear) and quantized.gate.weight.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(quantized.gate.weight.array), np.asarray(moe.gate.weight.array))
    assert quantized.correction_bias.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(quantized.correction_bias.array), np.asarray(moe.correction_bias.array))
    shared = (quantized.shared.gate_proj, quantized.shared.up_proj, quantized.shared.down_proj)
    experts = (quantized.experts.gate_proj, quantized.experts.up_proj, quantized.experts.down_proj)
    assert all(isinstance(m, Int8Linear) and m.weight.dtype == jnp.int8 for m in shared)
    assert all(isinstance(m, Int8MoELinear) and m.weight.dtype == jnp.int8 for m in experts)
    held = lambda m: m.weight.astype(jnp.float32) * m.scale  # noqa: E731
    dequantized = eqx.tree_at(
        lambda b: [b.shared.gate_proj.weight, b.shared.up_proj.weight, b.shared.down_proj.weight,
                   b.experts.gate_proj.weight, b.experts.up_proj.weight, b.experts.down_proj.weight],
        moe, [held(m) for m in (*shared, *experts)])
    x = hax.random.normal(jax.random.PRNGKey(1), (Tokens, Embed))
    got = np.asarray(quantized(x).array)
    np.testing.assert_allclose(got, np.asarray(dequantized(x).array), rtol=1e-5, atol=1e-5)
    assert np.abs(got - np.asarray(moe(x).array)).max() > 1e-4  # the weights are quantized


def test_the_sparse_layers_are_those_transformers_makes_sparse():
    hf = {"num_hidden_layers": 6, "num_experts": 8}
    assert sparse_layers(hf) == [True] * 6
    assert sparse_layers({**hf, "decoder_sparse_step": 2}) == [False, True] * 3
    assert sparse_layers({**hf, "mlp_only_layers": [0, 4]}) == [False, True, True, True, False, True]
    assert sparse_layers({**hf, "num_experts": 0}) == [False] * 6


@pytest.mark.parametrize("scan_layers,backend", [(False, "cpu"), (True, "xla"), (False, "tpu")])
def test_qwen3_moe_answers_as_transformers(checkpoint_factory, scan_layers, backend):
    """Every layer sparse (8 experts, 2 a token, top-k weights renormalized): stacked, so the scanned
    loop runs it too."""
    model_dir = checkpoint_factory("qwen3_moe")
    engine = LLMEngine(EngineConfig(model=str(model_dir), attention_backend=backend, scan_layers=scan_layers,
                                    **TIGHT))
    moe = engine.executor.runner.model.first_layer.mlp
    assert isinstance(moe, MoE)
    if backend == "cpu":  # the kernels' grouped products, each expert's packed weight read in place
        assert not moe.tiled and isinstance(moe.experts.down_proj, PackedExperts)
    else:  # XLA on CPUs: expert by expert
        assert moe.tiled
    assert_greedy_parity(engine, model_dir)


def test_qwen3_moe_with_dense_and_sparse_layers_answers_as_transformers(checkpoint_factory):
    """Every other layer sparse (decoder_sparse_step 2), the top-k weights not renormalized: the
    layers differ, so they run unrolled even where a scanned loop is asked for."""
    model_dir = checkpoint_factory("qwen3_moe", decoder_sparse_step=2, norm_topk_prob=False)
    engine = LLMEngine(EngineConfig(model=str(model_dir), attention_backend="cpu", scan_layers=True, **TIGHT))
    layers = engine.executor.runner.model.layers
    assert isinstance(layers, tuple) and [isinstance(layer.mlp, MoE) for layer in layers] == [False, True]
    assert_greedy_parity(engine, model_dir)


def moe_info(experts: int, width: int, block: int = 1) -> ModelInfo:
    return ModelInfo(family="qwen3_moe", num_layers=2, hidden_size=64, num_heads=8, num_kv_heads=8, head_dim=8,
                     intermediate_size=512, vocab_size=512, max_position_embeddings=512, eos_token_ids=(1,),
                     dtype="float32", num_experts=experts, expert_intermediate_size=width, expert_block=block)


def test_the_planner_splits_experts_whole_when_their_split_mlps_would_be_narrower_than_a_lane_tile():
    assert plan_experts(moe_info(128, 768), 8, None) is True  # Qwen3-30B-A3B on 8 chips: 96 lanes each
    assert plan_experts(moe_info(8, 14336), 8, None) is False  # Mixtral-8x7B: 1792 lanes each
    assert plan_experts(moe_info(8, 14336), 8, 8) is True  # asked for
    assert plan_experts(moe_info(6, 768), 4, None) is False  # 6 experts do not split 4 ways; 192 lanes each
    assert plan_experts(moe_info(128, 768), 1, None) is False
    assert plan_experts(moe_info(0, 0), 8, None) is False  # dense
    layout = plan_layout(moe_info(128, 768), 8)
    assert layout.axis_mapping["experts"] == "model" and "expert_mlp" not in layout.axis_mapping
    assert plan_layout(moe_info(8, 14336), 8).axis_mapping["expert_mlp"] == "model"
    assert plan_experts(moe_info(128, 2880), 16, None) is False  # 180 lanes each
    assert plan_experts(moe_info(128, 2880, block=32), 16, None) is True  # gpt-oss-120b's MXFP4: 90 blocks of 32


def test_an_expert_split_that_cannot_be_made_is_refused_with_what_can():
    with pytest.raises(ValueError, match=r"expert_parallel_size must be 1 or tensor_parallel_size \(8\), got 4"):
        plan_experts(moe_info(128, 768), 8, 4)
    with pytest.raises(ValueError, match="expert_parallel_size=4 does not divide the model's 6 experts; set "
                                         "expert_parallel_size: 1"):
        plan_experts(moe_info(6, 768), 4, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide the model's expert MLP size 766 nor "
                                         "its 6 experts"):
        plan_experts(moe_info(6, 766), 4, None)
    with pytest.raises(ValueError, match="does not divide the model's expert MLP size 2880 in blocks of 32 nor its 12"):
        plan_experts(moe_info(12, 2880, block=32), 16, None)
