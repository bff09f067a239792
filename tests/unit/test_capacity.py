"""The capacity planner (engine.generate.runner.memory_plan): hand-computed figures for a tiny
Llama, and an engine config that cannot fit refused before a weight is loaded, with what to change."""

from __future__ import annotations

import json

import pytest

from engine.config import EngineConfig
from engine.generate.runner import memory_plan

# A bf16 Llama of 2 layers, width 64, MLP 128, 4 heads of 16 over 2 KV heads, 256 tokens, untied head.
TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=1)

# Elements per device. Embedding and LM head 256 x 64 each (split by vocabulary); per layer q 64x64,
# k and v 64x32 each (64x64 once KV heads are repeated for 4 devices), o 64x64, gate/up/down 64x128
# each (all split), two norms of 64 (replicated); the final norm 64 (replicated). Two bytes each.
WEIGHT_BYTES = {
    1: 2 * (2 * 256 * 64 + 2 * (4096 + 2048 + 2048 + 4096 + 3 * 8192 + 128) + 64),
    2: 2 * (2 * 256 * 64 // 2 + 2 * ((4096 + 2048 + 2048 + 4096 + 3 * 8192) // 2 + 128) + 64),
    4: 2 * (2 * 256 * 64 // 4 + 2 * ((4 * 4096 + 3 * 8192) // 4 + 128) + 64),
}
# One page over both layers: 16 tokens x KV heads x 16 x (key, value) x 2 bytes, per device.
PAGE_BYTES = {1: 2 * 16 * 2 * 16 * 2 * 2, 2: 2 * 16 * 2 * 16 * 2 * 2 // 2, 4: 2 * 16 * 4 * 16 * 2 * 2 // 4}


@pytest.fixture
def tiny_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return tmp_path  # config.json only: planning never reads weights


def test_weights_and_pages_per_device_are_the_hand_computed_ones(tiny_dir):
    config = EngineConfig(model=str(tiny_dir))
    for size in (1, 2, 4):
        plan = memory_plan.plan(config, size, 2**20)
        assert (plan.weight_bytes, plan.kv_bytes_per_page) == (WEIGHT_BYTES[size], PAGE_BYTES[size])
    assert WEIGHT_BYTES == {1: 213632, 2: 107136, 4: 57984}


def test_loading_with_repeated_kv_heads_is_counted(tiny_dir):
    """At TP 4 the 2 KV heads are repeated twice: k and v (2 layers x 64 x 2 heads x 16, bf16: 16 KiB
    in all) load whole on every device and are repeated whole (32 KiB) before they split (8 KiB kept)."""
    config = EngineConfig(model=str(tiny_dir))
    assert memory_plan.plan(config, 2, 2**20).loading_extra_bytes == 0
    plan = memory_plan.plan(config, 4, 57984 + 40960)
    assert plan.loading_extra_bytes == 3 * 16384 - 2 * 16384 // 4 == 40960
    assert plan.problem() == ("loading takes 0.00 GiB per device at tensor_parallel_size=4 (the k and v projections "
                              "load whole, then are repeated for the devices), more than the 0.00 GiB a device has")
    assert memory_plan.plan(config, 4, 2**20).problem() is None
    int8 = EngineConfig(model=str(tiny_dir), quantization="int8")  # made on the host, placed as served
    assert memory_plan.plan(int8, 4, 2**20).loading_extra_bytes == 0


def test_the_pool_is_what_the_memory_left_after_the_weights_holds(tiny_dir):
    plan = memory_plan.plan(EngineConfig(model=str(tiny_dir)), 1, 2**20)
    assert plan.pages == int((2**20 - 213632) * 0.9) // 4096 == 183
    assert plan.kv_tokens == 182 * 16
    assert plan.sequences_at(256) == 182 // 16 == 11
    assert plan.problem() is None


def test_the_smallest_tensor_parallel_size_that_fits(tiny_dir):
    config = EngineConfig(model=str(tiny_dir))
    assert memory_plan.smallest_tensor_parallel(config, 200_000, 4).tensor_parallel_size == 2
    assert memory_plan.smallest_tensor_parallel(config, 2**20, 4).tensor_parallel_size == 1
    assert memory_plan.smallest_tensor_parallel(config, 50_000, 4) is None


def test_a_config_that_cannot_fit_is_refused_with_what_to_change(tiny_dir):
    config = EngineConfig(model=str(tiny_dir))
    with pytest.raises(ValueError) as refused:
        memory_plan.check_fits(config, 200_000, 4)
    pages = int((200_000 - 107136) * 0.9) // 2048
    int8 = memory_plan.plan(EngineConfig(model=str(tiny_dir), quantization="int8"), 1, 200_000)
    assert int8.problem() is None and int8.kv_tokens == 288  # int8 weights at tensor_parallel_size 1 fit too
    assert str(refused.value) == (
        "the model does not fit: the weights take 0.00 GiB per device at tensor_parallel_size=1, more than the "
        f"0.00 GiB a device has; set tensor_parallel_size: 2 (it fits {(pages - 1) * 16} KV tokens); or set "
        "quantization: int8 (it fits 288 KV tokens)")
    with pytest.raises(ValueError) as refused:
        memory_plan.check_fits(EngineConfig(model=str(tiny_dir), quantization="int8"), 50_000, 1)
    assert str(refused.value).endswith("; use more devices (no tensor_parallel_size up to the 1 here fits)")  # no int8 advice
    memory = 213632 + 3 * 4096 * 10 // 9 + 1
    with pytest.raises(ValueError) as refused:
        memory_plan.check_fits(config, memory, 1)
    int8 = memory_plan.plan(EngineConfig(model=str(tiny_dir), quantization="int8"), 1, memory)
    assert str(refused.value).endswith(
        "the KV pool holds 3 pages of 16 tokens, fewer than one sequence of max_model_len=256 needs (17); lower "
        "max_model_len or use more devices (no tensor_parallel_size up to the 1 here fits); or set quantization: "
        f"int8 (it fits {int8.kv_tokens} KV tokens)") and int8.kv_tokens == 384
    with pytest.raises(ValueError, match=r"; lower max_model_len, set kv_cache_dtype: bfloat16 or use more devices"):
        memory_plan.check_fits(EngineConfig(model=str(tiny_dir), kv_cache_dtype="float32"), 213632 + 3 * 8192, 1)


def test_the_engine_refuses_before_loading_a_weight(tiny_dir, monkeypatch):
    """The directory holds no weights at all: an engine that tried to load them would fail otherwise."""
    from engine.generate.runner import sharding
    from engine.generate.runner.model_runner import ModelRunner

    monkeypatch.setattr(sharding, "free_device_memory", lambda devices: 200_000)
    with pytest.raises(ValueError, match="the model does not fit: the weights take 0.00 GiB per device at "
                                         "tensor_parallel_size=1"):
        ModelRunner(EngineConfig(model=str(tiny_dir), attention_backend="xla"))


def test_a_draft_models_weights_and_keys_and_values_are_counted(tiny_dir, tmp_path_factory):
    """Speculative decoding with a draft model: its weights beside the served model's, its keys and
    values in every page (the pool's pages hold both)."""
    from engine.config import SpeculativeConfig

    draft_dir = tmp_path_factory.mktemp("draft")
    (draft_dir / "config.json").write_text(json.dumps({**TINY, "num_hidden_layers": 1}))
    config = EngineConfig(model=str(tiny_dir), speculative=SpeculativeConfig(method="draft_model",
                                                                             model=str(draft_dir)))
    for size in (1, 2, 4):
        plan = memory_plan.plan(config, size, 2**20)
        one_layer = memory_plan.plan(EngineConfig(model=str(draft_dir)), size, 2**20)
        assert plan.weight_bytes == WEIGHT_BYTES[size] + one_layer.weight_bytes
        assert plan.kv_bytes_per_page == PAGE_BYTES[size] + PAGE_BYTES[size] // 2


def test_a_latent_attention_page_holds_one_vector_a_token_and_layer(tmp_path):
    """DeepSeek-V3's cache: per token and layer the RoPE key and the latent (16 + 48 = 64 values
    here), stored once (it is the key and the value), copied once per device under tensor
    parallelism; not twice, as a model's separate keys and values are."""
    config_json = dict(model_type="deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=128,
                       moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                       q_lora_rank=48, kv_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                       n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
                       first_k_dense_replace=1, max_position_embeddings=256, torch_dtype="bfloat16",
                       eos_token_id=1, rms_norm_eps=1e-6)
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    config = EngineConfig(model=str(tmp_path))
    for size in (1, 2, 4):  # 3 layers x 16 tokens x 64 values x 2 bytes, one copy a device
        assert memory_plan.plan(config, size, 2**22).kv_bytes_per_page == 3 * 16 * 64 * 2 == 6144
