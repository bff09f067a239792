"""FP8 checkpoints (engine.formats.checkpoint_quantization, engine.layers.fp8): what each
`quantization_config` reads as and what is refused, the scales laid out on the weight's own axes
against the checkpoint's blocks, and FP8 checkpoints through the engine answering as transformers
does on their dequantized float32 weights, with the weights still FP8 on the device."""

from __future__ import annotations

import math

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.backends.cpu.kernels import PackedLinear
from engine.config import EngineConfig
from engine.formats.checkpoint_quantization import CheckpointQuantization, read_quantization
from engine.generate.engine import LLMEngine
from engine.layers.fp8 import FP8, Fp8Linear, Fp8MoELinear, dequantized, from_checkpoint, scale_axes
from engine.layers.moe import MoE
from engine.models.loading import abstract_model
from tests.support.fp8_checkpoints import dequantized as np_dequantized
from tests.support.fp8_checkpoints import make_fp8_checkpoint, quantization_config, quantized
from tests.support.parity import TIGHT, assert_greedy_parity


def test_each_quantization_config_reads_as_its_blocks_and_scale_tensor():
    fp8 = read_quantization({"quantization_config": quantization_config("fp8", (128, 128), "block")})
    assert fp8 == CheckpointQuantization("fp8", (128, 128), "weight_scale_inv", ())
    assert read_quantization({"quantization_config": {"quant_method": "fp8"}}).block == (128, 128)  # the default
    for strategy, block in [("tensor", (0, 0)), ("channel", (1, 0)), ("block", (64, 32))]:
        read = read_quantization({"quantization_config": quantization_config("compressed-tensors", (64, 32), strategy)})
        assert (read.method, read.block, read.scale_name) == ("compressed-tensors", block, "weight_scale")
    assert read_quantization({"torch_dtype": "bfloat16"}) is None


def test_which_modules_are_fp8_follows_each_methods_own_rule():
    """fp8: a module whose name contains a `modules_to_not_convert` entry is float (transformers'
    rule); compressed-tensors: `ignore` names match whole, or as `re:` patterns; the LM head never."""
    fp8 = CheckpointQuantization("fp8", (128, 128), "weight_scale_inv", ("mlp.gate", "layers.0.self_attn"))
    assert not fp8.quantizes("model.layers.3.mlp.gate") and fp8.quantizes("model.layers.3.mlp.experts.0.up_proj")
    assert not fp8.quantizes("model.layers.0.self_attn.q_proj") and fp8.quantizes("model.layers.1.self_attn.q_proj")
    assert not fp8.quantizes("lm_head")
    ct = CheckpointQuantization("compressed-tensors", (1, 0), "weight_scale",
                                ("lm_head", "model.layers.0.mlp.down_proj", "re:.*self_attn.k_proj$"))
    assert not ct.quantizes("model.layers.0.mlp.down_proj") and ct.quantizes("model.layers.10.mlp.down_proj")
    assert not ct.quantizes("model.layers.7.self_attn.k_proj") and ct.quantizes("model.layers.7.self_attn.q_proj")


@pytest.mark.parametrize("config,message", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported; supported: fp8 (block-wise"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fp8 format 'e5m2' is not supported; supported: e4m3"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {}}},
     "compressed-tensors format 'pack-quantized' with 1 config groups is not supported"),
    ({**quantization_config("compressed-tensors", (0, 0), "tensor"), "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
     "compressed-tensors weights of 4 bits, type 'int' are not supported"),
    ({**quantization_config("compressed-tensors", (0, 0), "tensor"), "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "group"}}}},
     "compressed-tensors weight strategy 'group' is not supported; supported: tensor, channel, block"),
])
def test_other_quantizations_are_refused_by_name_with_what_is_supported(config, message):
    with pytest.raises(ValueError, match=None) as refused:
        read_quantization({"quantization_config": config})
    assert message in str(refused.value)


def test_scales_keep_the_weights_axes_with_the_innermost_blocked_as_finely_as_needed():
    """Blocks of 16 over heads of 8 values (a block spans two heads): one scale per head; blocks
    of 128 over an axis of 192 (DeepSeek's q heads): one per 64 (64 divides both); per channel
    (block 0 over In): one per row of the outer In axes; an axis the layout splits: whole blocks on
    each device."""
    heads, head_dim = hax.Axis("heads", 4), hax.Axis("head_dim", 8)
    assert scale_axes((heads, head_dim), 16) == (heads, head_dim.resize(1))
    assert scale_axes((heads, hax.Axis("head_dim", 192)), 128) == (heads, hax.Axis("head_dim", 3))
    assert scale_axes((hax.Axis("embed", 64),), 0) == (hax.Axis("embed", 1),)
    assert scale_axes((heads, head_dim), 0) == (heads, head_dim.resize(1))
    # DeepSeek-V3's MLP (18,432 = 144 blocks of 128) split 32 ways: one scale per 64 (9 a device's share)
    assert scale_axes((hax.Axis("mlp", 18432),), 128, {"mlp": 32}) == (hax.Axis("mlp", 288),)
    assert scale_axes((hax.Axis("mlp", 18432),), 128, {"embed": 32}) == (hax.Axis("mlp", 144),)


@pytest.mark.parametrize("block", [(16, 32), (48, 40), (1, 0), (0, 0)])
def test_an_fp8_linear_holds_the_checkpoints_bytes_and_computes_with_its_dequantized_weight(block):
    """Out (kv_head 2, head_dim 24) = 48 rows, In 80 columns, from a checkpoint's [48, 80] FP8 weight
    and its scales: blocks that divide the axes, blocks of 48 x 40 that do not divide (48 over
    heads of 24, ceil(80 / 40)), per channel and per tensor. The product equals x @ the numpy
    dequantized weight."""
    Kv, HeadDim, Embed = hax.Axis("kv_head", 2), hax.Axis("head_dim", 24), hax.Axis("embed", 80)
    w = np.random.default_rng(0).standard_normal((48, 80)).astype(np.float32)
    q, scales = quantized(w, block)
    Scaled = ((*scale_axes((Embed,), block[1]),), scale_axes((Kv, HeadDim), block[0]))
    weight, scale = from_checkpoint(jnp.asarray(q), jnp.asarray(scales), (), (Embed,), (Kv, HeadDim), Scaled, block)
    assert weight.dtype == FP8 and weight.axes == (Embed, Kv, HeadDim) and scale.dtype == jnp.float32
    assert np.array_equal(np.asarray(weight.array).reshape(80, 48).T.view(np.uint8), q.view(np.uint8))
    linear = Fp8Linear(weight, scale, None, (Embed,), (Kv, HeadDim), block, "weight_scale_inv")
    x = hax.random.normal(jax.random.PRNGKey(0), (hax.Axis("position", 3), Embed))
    want = np.asarray(x.array) @ np_dequantized(q, scales, block).T
    got = linear(x).rearrange(("position", "kv_head", "head_dim")).array.reshape(3, 48)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    full = dequantized(weight, scale, jnp.float32).rearrange((Kv, HeadDim, Embed)).array.reshape(48, 80)
    assert np.array_equal(np.asarray(full), np_dequantized(q, scales, block))


def test_an_fp8_expert_stack_runs_each_expert_with_its_own_scales():
    """Three experts' [24, 32] weights, blocks of 8 x 16: one expert's product alone (the CPUs'
    tile loop) and the grouped product over rows of every expert equal the dequantized weights'."""
    Experts, In, Out = hax.Axis("experts", 3), hax.Axis("embed", 32), hax.Axis("expert_mlp", 24)
    rng = np.random.default_rng(1)
    ws = [rng.standard_normal((24, 32)).astype(np.float32) for _ in range(3)]
    parts = [quantized(w, (8, 16)) for w in ws]
    template = Fp8MoELinear.like(_moe_linear(Experts, In, Out), CheckpointQuantization("fp8", (8, 16), "w", ()))
    linear = template.loaded({"weight": jnp.stack([jnp.asarray(q) for q, _ in parts]),
                              "w": jnp.stack([jnp.asarray(s) for _, s in parts])})
    assert linear.weight.dtype == FP8 and linear.scale.axes == (Experts, In.resize(2), Out.resize(3))
    rows = rng.standard_normal((5, 32)).astype(np.float32)
    want = [rows @ np_dequantized(q, s, (8, 16)).T for q, s in parts]
    np.testing.assert_allclose(np.asarray(linear.expert_product(jnp.int32(2), jnp.asarray(rows))), want[2], rtol=1e-5)
    sizes = hax.named(jnp.array([2, 0, 3], jnp.int32), Experts)
    Rows = hax.Axis("expert_rows", 5)
    got = linear(hax.named(jnp.asarray(rows), (Rows, In)), sizes).rearrange((Rows, Out)).array
    np.testing.assert_allclose(np.asarray(got), np.concatenate([want[0][:2], want[2][2:]]), rtol=1e-5, atol=1e-5)


def _moe_linear(Experts, In, Out):
    import haliax.nn as hnn

    return hnn.MoELinear.init(Experts, In, Out, key=jax.random.PRNGKey(0), use_bias=False)


@pytest.fixture(scope="module")
def fp8_checkpoints(checkpoint_factory, tmp_path_factory):
    """`fp8_checkpoints(family, **make_fp8_checkpoint's options)` -> (FP8 checkpoint, its float32 copy)."""
    made = {}

    def make(family: str, **options):
        key = (family, tuple(sorted(options.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"fp8-{family}") / "ckpt"
            made[key] = make_fp8_checkpoint(checkpoint_factory(family), out, **options)
        return made[key]

    return make


@pytest.mark.parametrize("family,backend,scan_layers,options", [
    ("qwen3", "xla", True, {}),
    ("llama", "cpu", False, {"method": "compressed-tensors", "strategy": "channel"}),
    ("qwen2", "tpu", False, {"method": "compressed-tensors", "strategy": "block"}),
    ("qwen3_moe", "cpu", False, {"routers": True}),
    ("qwen3_moe", "tpu", False, {"method": "compressed-tensors", "strategy": "tensor"}),
])
def test_fp8_checkpoints_answer_as_transformers_on_their_dequantized_weights(fp8_checkpoints, family, backend,
                                                                               scan_layers, options):
    """Greedy tokens and logprobs equal transformers' on the float32 copy, with the weights FP8 on the
    device (a router's, where the checkpoint has it FP8, widened to float at load)."""
    model_dir, reference = fp8_checkpoints(family, **options)
    engine = LLMEngine(EngineConfig(model=str(model_dir), attention_backend=backend, scan_layers=scan_layers,
                                    **TIGHT))
    layer = engine.executor.runner.model.first_layer
    o_proj = layer.self_attn.o_proj  # on the cpu backend packed for its kernel, still FP8
    assert isinstance(o_proj, PackedLinear if backend == "cpu" else Fp8Linear) and o_proj.weight.dtype == FP8
    if isinstance(layer.mlp, MoE):
        assert isinstance(layer.mlp.experts.down_proj, Fp8MoELinear) and layer.mlp.gate.weight.dtype == jnp.float32
    assert_greedy_parity(engine, reference)


def test_an_fp8_checkpoints_planned_weights_are_a_byte_a_value(fp8_checkpoints):
    """The shapes jax-serve-aot and the capacity planner read: the FP8 model's linear weights take a
    quarter of the float32 model's bytes, plus their scales."""
    model_dir, reference = fp8_checkpoints("qwen3")
    fp8, _ = abstract_model(model_dir, "float32")
    float32, _ = abstract_model(reference, "float32")
    linears = lambda model: [m for m in jax.tree_util.tree_leaves(  # noqa: E731
        model.transformer, is_leaf=lambda m: isinstance(m, Fp8Linear)) if isinstance(m, Fp8Linear)]
    assert len(linears(fp8)) == 7  # q, k, v, o, gate, up, down (a stack of both layers each)
    weight_bytes = sum(math.prod(m.weight.array.shape) for m in linears(fp8))
    scale_bytes = sum(4 * math.prod(m.scale.array.shape) for m in linears(fp8))
    nbytes = lambda model: sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(model))  # noqa: E731
    assert nbytes(float32) - nbytes(fp8) == 3 * weight_bytes - scale_bytes
    # one float32 scale per block of 16 x 32, but o_proj's: its blocks of 32 inputs span two heads
    # of 16, so its scales are per head (4 x 4 a layer where the checkpoint has 2 x 4)
    assert scale_bytes == 4 * weight_bytes // (16 * 32) + 4 * 2 * 8


def test_int8_quantization_of_an_fp8_checkpoint_is_refused_with_what_to_change(fp8_checkpoints):
    model_dir, _ = fp8_checkpoints("qwen3")
    with pytest.raises(ValueError, match="checkpoint's are FP8 already: serve it without `quantization`"):
        LLMEngine(EngineConfig(model=str(model_dir), attention_backend="xla", quantization="int8", **TIGHT))

