"""Tensor parallelism on 4 host CPU devices: sharded engines answer exactly as transformers does,
and every device holds the share of each weight and of the KV cache that the split implies."""

from __future__ import annotations

import jax
import pytest

from engine.config import EngineConfig
from engine.generate.engine import LLMEngine
from tests.support.pallas_interpret import interpreted_kernel, interpreter_fixes  # noqa: F401
from tests.support.parity import TIGHT, assert_greedy_parity, assert_ragged_parity

EIGHT_HEADS = dict(hidden_size=128, num_heads=8, num_kv_heads=2, intermediate_size=256)
"""8 query heads over 2 KV heads: at TP=4 each KV head is repeated on two devices."""


@pytest.mark.parametrize("family,sizes,tp,backend,scan", [
    ("llama", {}, 2, "auto", None), ("llama", {}, 4, "auto", None), ("qwen3", {}, 2, "auto", None),
    ("qwen3", EIGHT_HEADS, 4, "auto", None), ("llama", EIGHT_HEADS, 4, "auto", True), ("llama", {}, 2, "tpu", None),
    ("olmo2", EIGHT_HEADS, 4, "auto", None), ("mixtral", EIGHT_HEADS, 4, "auto", True), ("gemma2", {}, 2, "auto", True),
    ("qwen3_moe", {}, 2, "tpu", None)],
    ids=["llama-tp2", "llama-tp4", "qwen3-tp2", "qwen3-8q2kv-tp4", "llama-8q2kv-tp4-scanned", "llama-tp2-tpu",
         "olmo2-8q2kv-tp4", "mixtral-8q2kv-tp4-scanned", "gemma2-tp2-scanned", "qwen3-moe-tp2-tpu"])
def test_sharded_greedy_tokens_and_logprobs_equal_transformers(checkpoint_factory, family, sizes, tp, backend, scan):
    """Queueing, chunking and preemption as in the single-device parity tests. auto gives way to
    xla: the cpu backend's kernels cannot shard. The xla backend unrolls on a CPU unless asked to
    scan (as it does on accelerators); the tpu backend scans."""
    model_dir = checkpoint_factory(family, **sizes)
    engine = LLMEngine(EngineConfig(model=str(model_dir), tensor_parallel_size=tp, attention_backend=backend,
                                    scan_layers=scan, **TIGHT))
    described = engine.describe()
    assert (described["tensor_parallel_size"], described["num_devices"]) == (str(tp), str(tp))
    assert described["attention_backend"] == ("xla" if backend == "auto" else backend)
    assert described["mesh"] == f"data=1,model={tp}"
    assert_greedy_parity(engine, model_dir)


def shard_shapes(array: jax.Array) -> list[tuple[int, ...]]:
    assert len({shard.device for shard in array.addressable_shards}) == len(array.addressable_shards)
    return [shard.data.shape for shard in array.addressable_shards]


def test_every_device_holds_its_share(checkpoint_factory):
    """Qwen3 with 8 query heads and 2 KV heads at TP=4 (head_size 16, MLP 256, vocab 492)."""
    engine = LLMEngine(EngineConfig(model=str(checkpoint_factory("qwen3", **EIGHT_HEADS)), tensor_parallel_size=4,
                                    **TIGHT))
    model = engine.executor.runner.model
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp  # the xla backend unrolls on a CPU
    # weights are (in..., out...): q (embed, kv_head, q_heads_per_group, head_size), KV heads repeated 2 -> 4
    assert shard_shapes(attn.q_proj.weight.array) == [(128, 1, 2, 16)] * 4
    assert shard_shapes(attn.k_proj.weight.array) == [(128, 1, 16)] * 4
    assert shard_shapes(attn.v_proj.weight.array) == [(128, 1, 16)] * 4
    assert shard_shapes(attn.o_proj.weight.array) == [(2, 16, 128)] * 4  # (heads, head_size, embed)
    assert shard_shapes(mlp.gate_proj.weight.array) == [(128, 64)] * 4
    assert shard_shapes(mlp.up_proj.weight.array) == [(128, 64)] * 4
    assert shard_shapes(mlp.down_proj.weight.array) == [(64, 128)] * 4
    assert shard_shapes(model.embeddings.token_embeddings.weight.array) == [(123, 128)] * 4
    assert shard_shapes(model.lm_head.weight.array) == [(128, 123)] * 4
    # the KV cache: keys [layer, page, kv_head, head_dim, slot], one (repeated) KV head per device
    cache = engine.executor.runner.cache
    assert shard_shapes(cache.k) == [(2, 40, 1, 16, 4)] * 4
    assert shard_shapes(cache.v) == [(2, 40, 1, 4, 16)] * 4


def test_the_tpu_backend_splits_its_cache_by_kv_head(checkpoint_factory):
    engine = LLMEngine(EngineConfig(model=str(checkpoint_factory("llama")), tensor_parallel_size=2,
                                    attention_backend="tpu", **TIGHT))
    # every layer's pages in one array: [layer * page, slot, 2 * kv_head, head_dim], keys and values interleaved
    assert shard_shapes(engine.executor.runner.cache.pages) == [(2 * 40, 4, 2, 16)] * 2


def test_the_tpu_kernel_split_over_two_devices_answers_as_transformers_does(checkpoint_factory, interpreted_kernel):  # noqa: F811
    """The Pallas kernel (TPU interpret mode) under shard_map, each device over its own KV head
    (4 new tokens: the one-device tests in test_tpu_kernel.py decode longer)."""
    model_dir = checkpoint_factory("llama")
    engine = LLMEngine(EngineConfig(model=str(model_dir), tensor_parallel_size=2, attention_backend="tpu", **TIGHT))
    assert engine.executor.runner.backend.interpret
    assert shard_shapes(engine.executor.runner.cache.pages) == [(2 * 40, 4, 2, 128)] * 2  # one KV head each
    assert_ragged_parity(engine, model_dir, new_tokens=4)


def test_int8_weights_split_like_their_float_originals_and_answer_as_on_one_device(checkpoint_factory):
    """Quantized at load, then split: each device holds its share of the int8 weights and of their
    scales, and the greedy tokens equal the unsplit int8 engine's."""
    import dataclasses

    import jax.numpy as jnp

    from engine.generate.request import SamplingParams
    from tests.support.parity import make_prompts, run_to_completion, tokens_of

    config = EngineConfig(model=str(checkpoint_factory("qwen3", **EIGHT_HEADS)), quantization="int8",
                          attention_backend="xla", **TIGHT)
    prompts = make_prompts([5, 30, 12], seed=4)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    answers = []
    for tp in (1, 4):
        engine = LLMEngine(dataclasses.replace(config, tensor_parallel_size=tp))
        deltas = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
        answers.append([tokens_of(deltas[str(i)]) for i in range(len(prompts))])
    assert answers[0] == answers[1]
    layer = engine.executor.runner.model.layers[0]
    q, down = layer.self_attn.q_proj, layer.mlp.down_proj
    assert q.weight.dtype == jnp.int8 and engine.describe()["quantization"] == "int8"
    assert shard_shapes(q.weight.array) == [(128, 1, 2, 16)] * 4 and shard_shapes(q.scale.array) == [(1, 2, 16)] * 4
    assert shard_shapes(down.weight.array) == [(64, 128)] * 4 and shard_shapes(down.scale.array) == [(128,)] * 4


def test_int8_weights_made_on_the_host_reach_the_devices_as_served(checkpoint_factory, monkeypatch):
    """Where the host's CPU is not one of the replica's devices (a TPU VM), the checkpoint loads and
    is quantized there and each device receives only its int8 share. Here device 3 stands in for the
    host of a TP 2 replica on devices 0 and 1: the tokens equal those of the weights made in place,
    and nothing of the model stays on device 3."""
    import dataclasses

    import jax.numpy as jnp

    from engine.generate.request import SamplingParams
    from engine.generate.runner import sharding
    from tests.support.parity import make_prompts, run_to_completion, tokens_of

    config = EngineConfig(model=str(checkpoint_factory("qwen3", **EIGHT_HEADS)), quantization="int8",
                          attention_backend="xla", tensor_parallel_size=2, **TIGHT)
    prompts = make_prompts([5, 30, 12], seed=4)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    answers = []
    for host in (None, jax.devices()[3]):
        monkeypatch.setattr(sharding, "host_device", lambda host=host: host)
        engine = LLMEngine(dataclasses.replace(config))
        assert engine.executor.runner.weights_host == host
        deltas = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
        answers.append([tokens_of(deltas[str(i)]) for i in range(len(prompts))])
    assert answers[0] == answers[1]
    model = engine.executor.runner.model
    placed = {device for leaf in jax.tree_util.tree_leaves(model) if isinstance(leaf, jax.Array)
              for device in leaf.devices()}
    assert placed == set(jax.devices()[:2])
    q = model.layers[0].self_attn.q_proj
    assert q.weight.dtype == jnp.int8 and shard_shapes(q.weight.array) == [(128, 1, 4, 16)] * 2


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_mixtral_experts_split_over_the_devices(checkpoint_factory, tmp_path, quantization):
    """expert_parallel_size 1: every expert's MLP splits by its intermediate dimension (as a dense
    MLP does): each device holds a quarter of each of the 4 experts (int8: and of their scales);
    the router is replicated (and kept in float). Greedy tokens and logprobs are transformers'."""
    from tests.support.parity import dequantized_copy

    model_dir = checkpoint_factory("mixtral", **EIGHT_HEADS)
    engine = LLMEngine(EngineConfig(model=str(model_dir), tensor_parallel_size=4, expert_parallel_size=1,
                                    quantization=quantization, **TIGHT))
    moe = engine.executor.runner.model.layers[0].block_sparse_moe
    if quantization:
        assert moe.experts.gate_proj.weight.dtype == "int8" and moe.gate.weight.dtype == "float32"
        assert shard_shapes(moe.experts.gate_proj.scale.array) == [(4, 64)] * 4
        assert shard_shapes(moe.experts.down_proj.scale.array) == [(4, 128)] * 4
    assert [(ax.name, ax.size) for ax in moe.experts.gate_proj.weight.axes] == [("experts", 4), ("embed", 128),
                                                                               ("expert_mlp", 256)]
    assert shard_shapes(moe.experts.gate_proj.weight.array) == shard_shapes(moe.experts.up_proj.weight.array) == [
        (4, 128, 64)] * 4
    assert shard_shapes(moe.experts.down_proj.weight.array) == [(4, 64, 128)] * 4
    assert shard_shapes(moe.gate.weight.array) == [(128, 4)] * 4
    assert_greedy_parity(engine, dequantized_copy(model_dir, tmp_path / "dequantized") if quantization else model_dir)


@pytest.mark.parametrize("family,quantization", [("mixtral", None), ("mixtral", "int8"), ("qwen3_moe", None)])
def test_experts_split_whole_over_the_devices_answer_as_transformers(checkpoint_factory, tmp_path, family,
                                                                     quantization):
    """Expert parallelism, as the planner picks it when an expert's MLP split 4 ways would be
    narrower than 128 lanes: each device holds whole experts (Mixtral's 4: one each; Qwen3-MoE's
    8: two each) and runs the rows routed to them; greedy tokens and logprobs are transformers'
    (int8: on the weights int8 holds)."""
    from tests.support.parity import dequantized_copy

    model_dir = checkpoint_factory(family, **EIGHT_HEADS)
    engine = LLMEngine(EngineConfig(model=str(model_dir), tensor_parallel_size=4, quantization=quantization,
                                    **TIGHT))
    layer = engine.executor.runner.model.layers[0]
    experts = getattr(layer, "block_sparse_moe", None) or layer.mlp
    count = experts.experts.gate_proj.weight.resolve_axis("experts").size
    width = experts.experts.gate_proj.weight.resolve_axis("expert_mlp").size
    assert shard_shapes(experts.experts.gate_proj.weight.array) == [(count // 4, 128, width)] * 4
    if quantization:
        assert shard_shapes(experts.experts.gate_proj.scale.array) == [(count // 4, width)] * 4
    assert shard_shapes(experts.gate.weight.array) == [(128, count)] * 4  # the router whole on every device
    assert_greedy_parity(engine, dequantized_copy(model_dir, tmp_path / "dequantized") if quantization else model_dir)


@pytest.mark.parametrize("family,expert_parallel_size", [("qwen3", None), ("qwen3_moe", None), ("qwen3_moe", 1)],
                         ids=["dense", "experts-whole", "expert-mlps-split"])
def test_fp8_checkpoints_split_over_the_devices_answer_as_transformers(checkpoint_factory, tmp_path, family,
                                                                       expert_parallel_size):
    """An FP8 checkpoint (blocks of 16 x 32) at TP 4: each device holds its share of every FP8
    weight and of its scales (KV heads repeated with theirs; experts whole, or each expert's MLP
    split); greedy tokens and logprobs are transformers' on the dequantized float32 weights."""
    from tests.support.fp8_checkpoints import make_fp8_checkpoint

    model_dir, reference = make_fp8_checkpoint(checkpoint_factory(family, **EIGHT_HEADS), tmp_path / "fp8")
    engine = LLMEngine(EngineConfig(model=str(model_dir), tensor_parallel_size=4,
                                    expert_parallel_size=expert_parallel_size, **TIGHT))
    layer = engine.executor.runner.model.layers[0]
    attn = layer.self_attn
    assert attn.k_proj.weight.dtype == "float8_e4m3fn"
    assert shard_shapes(attn.k_proj.weight.array) == [(128, 1, 16)] * 4  # 2 KV heads repeated to 4
    assert shard_shapes(attn.k_proj.scale.array) == [(4, 1, 1)] * 4  # (embed / 32, kv_head, head_dim / 16)
    assert shard_shapes(attn.o_proj.scale.array) == [(2, 1, 8)] * 4  # (heads, head_dim / 16, embed / 16)
    if family == "qwen3":
        assert shard_shapes(layer.mlp.down_proj.scale.array) == [(2, 8)] * 4  # (mlp / 32, embed / 16)
    else:
        experts = layer.mlp.experts
        split = {None: [(2, 4, 8)] * 4, 1: [(8, 1, 8)] * 4}[expert_parallel_size]  # (experts, mlp / 32, embed / 16)
        assert shard_shapes(experts.down_proj.scale.array) == split
        assert shard_shapes(layer.mlp.gate.weight.array) == [(128, 8)] * 4
    assert_greedy_parity(engine, reference)


def test_an_mxfp4_gpt_oss_split_over_four_devices_answers_as_transformers(checkpoint_factory, tmp_path):
    """gpt-oss (8 query heads over 2 KV heads, so KV heads and the sinks regroup at TP 4) with MXFP4
    experts (4 of 128: whole experts, one a device, their 4 blocks of 32 never split): each device
    holds its expert's bytes; greedy tokens and logprobs are transformers' on the dequantized experts."""
    from tests.support.mxfp4_checkpoints import make_mxfp4_checkpoint

    model_dir, reference = make_mxfp4_checkpoint(checkpoint_factory("gpt_oss", **EIGHT_HEADS), tmp_path / "mxfp4")
    engine = LLMEngine(EngineConfig(model=str(model_dir), tensor_parallel_size=4, **TIGHT))
    layer = engine.executor.runner.model.layers[0]
    down = layer.mlp.experts.down_proj
    assert shard_shapes(down.blocks.array) == [(1, 128, 4, 16)] * 4  # (experts, embed, mlp / 32, 16 bytes)
    assert shard_shapes(layer.self_attn.sinks.array) == [(1, 2)] * 4  # (kv_head, q_heads_per_group)
    assert_greedy_parity(engine, reference)


def test_deepseek_v3_split_over_four_devices_answers_as_transformers(checkpoint_factory):
    """Latent attention at TP 4: each device holds a copy of the latent cache (one KV head a device)
    and its 2 of the 8 query heads; the experts whole (2 a device), the shared MLP split as a dense
    MLP; greedy tokens and logprobs are transformers'."""
    model_dir = checkpoint_factory("deepseek_v3", **EIGHT_HEADS)
    engine = LLMEngine(EngineConfig(model=str(model_dir), tensor_parallel_size=4, **TIGHT))
    runner = engine.executor.runner
    layer = runner.model.layers[1]
    assert layer.self_attn.kv_copies == 4
    assert shard_shapes(layer.self_attn.kv_b_proj.array) == [(2, 32, 48)] * 4  # (heads, nope + v, latent)
    assert shard_shapes(layer.mlp.experts.gate_proj.weight.array) == [(2, 128, 64)] * 4
    assert shard_shapes(layer.mlp.shared.down_proj.weight.array) == [(16, 128)] * 4
    cache = runner.cache  # the latent once a token and layer (it is the key and the value): [layer, page, copy, slot, 64]
    assert cache.k is None and shard_shapes(cache.v) == [(*cache.v.shape[:2], 1, runner.config.page_size, 64)] * 4
    assert_greedy_parity(engine, model_dir)


def test_a_llava_decoder_split_over_two_devices_places_images_as_on_one(tmp_path):
    """Image features (replicated beside the split decoder) go into the prompt as on one device:
    the greedy tokens of a prompt with two images equal transformers'."""
    import numpy as np
    import torch
    import transformers

    from engine.formats.model_sources import resolve_model
    from engine.generate.images import ImageInput
    from engine.generate.request import SamplingParams
    from serve_app.media.images import content_hash
    from tests.support.parity import make_prompts, tokens_of
    from tests.support.tiny_models import make_llava_checkpoint

    checkpoint = make_llava_checkpoint(tmp_path / "llava")
    engine = LLMEngine(EngineConfig(model=str(resolve_model(str(checkpoint), cache_dir=tmp_path / "cache")),
                                    tensor_parallel_size=2, **{**TIGHT, "max_model_len": 160, "num_pages": 120}))
    images = [np.random.default_rng(seed).standard_normal((3, 32, 32)).astype(np.float32) for seed in (1, 2)]
    placeholder = [engine.image_token_id] * engine.images.tokens_per_image
    text = make_prompts(lengths=(12,), vocab=300)[0]
    prompt = text[:3] + placeholder + text[3:8] + placeholder + text[8:]
    engine.add_request("r", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                       images=tuple(ImageInput(content_hash(p), p) for p in images))
    deltas = []
    while engine.has_work():
        deltas += engine.step()
    reference = transformers.LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), pixel_values=torch.tensor(np.stack(images)),
                                      max_new_tokens=8, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(prompt):].tolist()
    assert tokens_of(deltas) == expected
