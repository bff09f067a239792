"""DeepSeek-V3 (engine.models.decoder's `deepseek_v3`): multi-head latent attention served absorbed
(engine.layers.latent_attention: the cache holds one vector a token and layer, the RoPE key and the
latent), a dense first layer, then experts with sigmoid, group-limited routing and a shared MLP.
Tiny checkpoints, float and FP8, through the engine against transformers on every backend."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from engine.backends.tpu import TpuBackend
from engine.config import EngineConfig
from engine.formats.checkpoint_config import model_info
from engine.generate.engine import LLMEngine
from engine.generate.runner import sharding
from engine.generate.runner.kv_pool import cache_shape
from engine.layers.fp8 import FP8
from engine.layers.latent_attention import LatentAttention
from engine.layers.moe import MoE
from engine.models.decoder import latent_sizes, prepared
from tests.support.fp8_checkpoints import make_fp8_checkpoint
from tests.support.parity import TIGHT, assert_greedy_parity


@pytest.fixture(scope="module")
def deepseek(checkpoint_factory):
    return checkpoint_factory("deepseek_v3")


def test_the_cache_holds_the_latent_and_the_rope_key_once_a_token(deepseek):
    """One KV head of kv_lora_rank + qk_rope_head_dim (48 + 16) values, whatever the query heads (4)."""
    info = model_info(deepseek)
    assert (info.num_kv_heads, info.head_dim, info.num_heads) == (1, 64, 4)
    assert (info.num_experts, info.expert_intermediate_size) == (8, 32)


def test_the_tpu_cache_holds_the_latent_once_a_token_and_layer(deepseek, tmp_path):
    """DeepSeek-V3's sizes (61 layers, a 512-wide latent and a 64-wide RoPE key) on the tpu backend
    built for the kernel, pages of 16 in bfloat16: one array of 576 values a token and layer, stored
    in 640 lanes, 61 * 16 * 640 * 2 bytes a page; keys and values would take twice that."""
    config = {**json.loads((deepseek / "config.json").read_text()), "num_hidden_layers": 61, "kv_lora_rank": 512,
              "qk_rope_head_dim": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    info = model_info(tmp_path)
    shape = cache_shape(info, sharding.plan_layout(info, 1), page_size=16, num_pages=3, dtype=jnp.bfloat16)
    assert (shape.kv_heads, shape.head_dim, shape.values_are_keys) == (1, 576, True)
    backend = TpuBackend(Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model")), "model",
                         interpret_as="TPU v5 lite")
    assert backend.cache_bytes_per_page(shape) == 61 * 16 * 1 * 640 * 2 == 1_249_280
    assert backend.cache_bytes_per_page(dataclasses.replace(shape, values_are_keys=False)) == 2 * 1_249_280
    cache = backend.init_cache(dataclasses.replace(shape, num_layers=2))
    assert (cache.pages.shape, cache.pages.dtype, cache.values_are_keys) == ((2 * 3, 16, 1, 640), jnp.bfloat16, True)
    assert cache.pages.nbytes == 3 * backend.cache_bytes_per_page(dataclasses.replace(shape, num_layers=2))


def test_the_softmax_scale_takes_yarns_mscale_squared():
    """transformers' DeepseekV3Attention: qk_head_dim ** -0.5 times (0.1 * mscale_all_dim * ln(factor) + 1) ** 2."""
    hf = {"num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
          "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_scaling": {"factor": 40, "mscale_all_dim": 1.0}}
    assert latent_sizes(hf).scaling == pytest.approx(192 ** -0.5 * (0.1 * np.log(40) + 1) ** 2, rel=1e-12)
    assert latent_sizes({**hf, "rope_scaling": None}).scaling == pytest.approx(192 ** -0.5, rel=1e-12)


def test_interleaved_rope_rows_become_halves_and_the_prediction_layers_are_dropped():
    """rope_interleave: each head's RoPE rows (x0, x1, x2, x3) read as (x0, x2, x1, x3), the nope rows
    untouched; layers past num_hidden_layers (multi-token prediction) are not loaded."""
    hf = {"model_type": "deepseek_v3", "num_hidden_layers": 1, "num_attention_heads": 2, "qk_nope_head_dim": 2,
          "qk_rope_head_dim": 4, "kv_lora_rank": 3}
    q_b = np.arange(12)[:, None] * np.ones((1, 5))
    kv_a = np.arange(7)[:, None] * np.ones((1, 5))
    out = prepared(hf, {"model.layers.0.self_attn.q_b_proj.weight": q_b,
                        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": kv_a,
                        "model.layers.1.self_attn.q_b_proj.weight": q_b, "model.norm.weight": np.ones(5)})
    assert sorted(out) == ["model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                           "model.layers.0.self_attn.q_b_proj.weight", "model.norm.weight"]
    assert out["model.layers.0.self_attn.q_b_proj.weight"][:, 0].tolist() == [0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]
    assert out["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"][:, 0].tolist() == [0, 1, 2, 3, 5, 4, 6]


@pytest.mark.parametrize("backend,scan_layers", [("cpu", False), ("xla", True), ("tpu", False)])
def test_deepseek_v3_answers_as_transformers(deepseek, backend, scan_layers):
    """Greedy tokens and logprobs equal transformers', with queueing, chunking, preemption and prefix
    hits; the first layer dense and the other a mixture of experts (so the layers run unrolled)."""
    engine = LLMEngine(EngineConfig(model=str(deepseek), attention_backend=backend, scan_layers=scan_layers,
                                    **TIGHT))
    layers = engine.executor.runner.model.layers
    assert isinstance(layers[0].self_attn, LatentAttention) and not isinstance(layers[0].mlp, MoE)
    moe = layers[1].mlp
    assert isinstance(moe, MoE) and moe.shared is not None and moe.correction_bias.dtype == jnp.float32
    if backend == "tpu":  # the latent and the RoPE key (48 + 16) once a token and layer: keys alone
        cache = engine.executor.runner.cache
        assert (cache.pages.shape[1:], cache.values_are_keys) == ((4, 1, 64), True)
    assert_greedy_parity(engine, deepseek)


def test_an_fp8_deepseek_answers_as_transformers_on_its_dequantized_weights(deepseek, tmp_path):
    """Blocks of 16 x 16 (each head's RoPE rows one block, so the interleave reorder keeps the scales):
    the projections, experts and shared MLP stay FP8, kv_b_proj (absorbed) and the router float."""
    model_dir, reference = make_fp8_checkpoint(deepseek, tmp_path / "fp8", block=(16, 16))
    config = json.loads((model_dir / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [16, 16]
    engine = LLMEngine(EngineConfig(model=str(model_dir), attention_backend="xla", **TIGHT))
    layer = engine.executor.runner.model.layers[1]
    assert layer.self_attn.q_b_proj.weight.dtype == FP8 and layer.mlp.shared.down_proj.weight.dtype == FP8
    assert layer.mlp.experts.up_proj.weight.dtype == FP8 and layer.self_attn.kv_b_proj.dtype == jnp.float32
    assert layer.mlp.gate.weight.dtype == jnp.float32
    assert_greedy_parity(engine, reference)
