"""Weight-only int8 (engine/layers/quantize.py): the quantizer's error bound, the modules against
their float originals, weight memory, and the real default model's greedy tokens against its
bfloat16 self on the cpu and xla backends."""

from __future__ import annotations

import dataclasses

import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.formats.model_sources import resolve_model
from engine.generate.engine import LLMEngine
from engine.generate.request import SamplingParams
from engine.layers.quantize import (
    Int8Embedding,
    Int8Linear,
    Int8MoELinear,
    quantize,
    quantize_model,
)
from tests.support.parity import TIGHT, assert_greedy_parity, dequantized_copy


def test_quantize_rounds_each_output_channel_to_its_own_scale():
    In, Out, Layers = hax.Axis("embed", 64), hax.Axis("mlp", 24), hax.Axis("layers", 3)
    w = hax.random.normal(jax.random.PRNGKey(0), (Layers, In, Out)) * hax.arange(Out).astype(jnp.float32)
    q, scale = quantize(w, In)
    assert q.dtype == jnp.int8 and q.axes == w.axes and scale.axes == (Layers, Out)
    w_np, q_np, s_np = np.asarray(w.array), np.asarray(q.array, np.float32), np.asarray(scale.array)
    np.testing.assert_allclose(s_np[:, 1:], np.abs(w_np).max(axis=1)[:, 1:] / 127, rtol=1e-6)
    assert np.abs(q_np).max() == 127
    assert np.all(np.abs(q_np * s_np[:, None, :] - w_np) <= s_np[:, None, :] / 2 + 1e-7)
    assert np.all(q_np[:, :, 0] == 0) and np.all(s_np[:, 0] == 1.0)  # an all-zero channel stays zero


def test_int8_modules_compute_what_their_float_originals_compute():
    Pos, Embed, Mlp, Vocab = hax.Axis("position", 5), hax.Axis("embed", 32), hax.Axis("mlp", 48), hax.Axis("vocab", 80)
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    linear = hnn.Linear.init(In=Embed, Out=Mlp, key=keys[0], use_bias=True)
    embedding = hnn.Embedding.init(Vocab, Embed, key=keys[1])
    x = hax.random.normal(keys[2], (Pos, Embed))
    ids = hax.named(jnp.array([0, 5, 79, 5, 3]), Pos)
    pairs = [(Int8Linear.from_linear(linear)(x), linear(x)),
             (Int8Embedding.from_embedding(embedding).embed(ids), embedding.embed(ids)),
             (Int8Embedding.from_embedding(embedding).unembed(x), embedding.unembed(x))]
    for got, want in pairs:
        assert got.axes == want.axes and got.dtype == want.dtype
        error = np.abs(np.asarray(got.array) - np.asarray(want.array)).max()
        assert 0 < error < 0.02 * np.abs(np.asarray(want.array)).max()


def test_int8_experts_scale_each_row_by_its_own_experts_scales():
    """Rows grouped by expert (2, 0, 3 rows for experts 0, 1, 2): the int8 product equals the float
    product over the dequantized weights, each row with its own expert's weights."""
    Experts, Rows, Embed, Mlp = hax.Axis("experts", 3), hax.Axis("token_repeat", 5), hax.Axis("embed", 32), \
        hax.Axis("mlp", 24)
    keys = jax.random.split(jax.random.PRNGKey(2), 2)
    moe = hnn.MoELinear.init(Experts, Embed, Mlp, key=keys[0], use_bias=False)
    moe = dataclasses.replace(moe, weight=moe.weight * (1 + hax.arange(Experts).astype(jnp.float32)))
    x = hax.random.normal(keys[1], (Rows, Embed))
    groups = hax.named(jnp.array([2, 0, 3]), Experts)
    int8 = Int8MoELinear.from_moe_linear(moe)
    assert int8.weight.dtype == jnp.int8 and int8.scale.axes == (Experts, Mlp)
    dequantized = dataclasses.replace(moe, weight=int8.weight.astype(jnp.float32) * int8.scale)
    got, want = int8(x, groups), dequantized(x, groups)
    assert got.axes == want.axes
    np.testing.assert_allclose(np.asarray(got.array), np.asarray(want.array), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(got.array) - np.asarray(moe(x, groups).array)).max() > 0  # it is quantized


def test_unknown_quantization_is_refused_by_name():
    with pytest.raises(ValueError, match="quantization must be None or 'int8', got 'int4'"):
        EngineConfig(model="/m", quantization="int4")
    with pytest.raises(ValueError, match=r"quantization 'fp8' is not supported; use one of \('int8',\)"):
        quantize_model(object(), "fp8")


# ---- parity: the int8 engine serves exactly the float model of its dequantized weights ----

@pytest.mark.parametrize("family,backend,scan", [("llama", "cpu", False), ("mixtral", "xla", True),
                                                 ("gemma2", "xla", False), ("qwen3", "tpu", False),
                                                 ("qwen3_moe", "cpu", False)])
def test_int8_engine_equals_transformers_on_the_dequantized_weights(checkpoint_factory, tmp_path, family, backend,
                                                                    scan):
    """Greedy tokens and logprobs (1e-3) of the int8 engine on the float checkpoint equal
    transformers' on the weights int8 holds: quantization is the only change, on every backend
    (the cpu kernel's int8 products, XLA's, Mixtral's and Qwen3-MoE's experts, a tied embedding)."""
    model_dir = checkpoint_factory(family)
    engine = LLMEngine(EngineConfig(model=str(model_dir), quantization="int8", attention_backend=backend,
                                    scan_layers=scan, **TIGHT))
    assert_greedy_parity(engine, dequantized_copy(model_dir, tmp_path / "dequantized"))


# ---- the default model ----

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a CPU cache is.",
           "List three prime numbers.", "Who wrote Hamlet?", "Translate 'good morning' into Spanish.",
           "What is 12 times 7?", "Give me a tip for learning to cook."]
NEW_TOKENS = 32
PARIS = [504, 3575, 282, 4649, 314, 7042, 30]
"""The tokens of "The capital of France is Paris." (tests/integration/test_default_model.py)."""


@pytest.fixture(scope="module")
def smollm2():
    path = resolve_model("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in PROMPTS]
    return path, prompts


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    last = {}
    while engine.has_work():
        for delta in engine.step():
            last.setdefault(delta.request_id, []).append(delta)
    return last


def weight_bytes(engine: LLMEngine) -> int:
    model = engine.executor.runner.model
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(model) if isinstance(leaf, jax.Array))


def greedy_continuations(config: EngineConfig, prompts) -> tuple[list[list[int]], int]:
    """(each prompt's NEW_TOKENS greedy tokens, the engine's weight bytes)."""
    engine = LLMEngine(config)
    try:
        greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outs = run(engine, {str(i): (p, greedy) for i, p in enumerate(prompts)})
        return [[t for d in outs[str(i)] for t in d.token_ids] for i in range(len(prompts))], weight_bytes(engine)
    finally:
        engine.shutdown()


def test_int8_default_model_agrees_with_bfloat16_and_halves_its_weights(smollm2):
    """The default deployment (cpu backend, bfloat16): greedy continuations of the bfloat16 model;
    the int8 model's greedy choice at each of their positions (teacher-forced: its top-1 prompt
    logprob over prompt + continuation) agrees on >= 95% of them (245 of 256 here; float32 weights:
    255). The int8 model still answers Paris."""
    path, prompts = smollm2
    base = EngineConfig(model=str(path), dtype="bfloat16", attention_backend="cpu", cpu_matmul="kernel",
                        max_num_seqs=8, max_model_len=256, warmup=False)  # one layout per weight, whatever is cached
    continuations, bf16_bytes = greedy_continuations(base, prompts)
    engine = LLMEngine(dataclasses.replace(base, quantization="int8"))
    try:
        int8_bytes = weight_bytes(engine)
        forced = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        outs = run(engine, {str(i): (p + c, forced) for i, (p, c) in enumerate(zip(prompts, continuations))})
        paris = run(engine, {"paris": (prompts[0], SamplingParams(max_tokens=8, temperature=0.0))})
    finally:
        engine.shutdown()
    agree = total = 0
    for i, (prompt, continuation) in enumerate(zip(prompts, continuations)):
        logprobs = outs[str(i)][0].prompt_logprobs
        for position, token in enumerate(continuation, start=len(prompt)):
            agree += logprobs[position].top[0][0] == token
            total += 1
    assert total == len(PROMPTS) * NEW_TOKENS
    assert agree / total >= 0.95, f"int8 agrees with bfloat16 on {agree} of {total} greedy positions"
    assert [t for d in paris["paris"] for t in d.token_ids][:7] == PARIS
    assert 0.5 < int8_bytes / bf16_bytes < 0.56, (int8_bytes, bf16_bytes)


def test_int8_on_the_xla_backend_halves_the_weights_and_answers_paris(smollm2):
    """The xla backend (accelerators' path) runs the int8 modules themselves."""
    path, prompts = smollm2
    base = EngineConfig(model=str(path), dtype="bfloat16", attention_backend="xla", max_num_seqs=2,
                        max_model_len=256, warmup=False)
    engine = LLMEngine(base)
    try:
        bf16_bytes = weight_bytes(engine)
    finally:
        engine.shutdown()
    engine = LLMEngine(dataclasses.replace(base, quantization="int8"))
    try:
        int8_bytes = weight_bytes(engine)
        paris = run(engine, {"paris": (prompts[0], SamplingParams(max_tokens=8, temperature=0.0))})
    finally:
        engine.shutdown()
    assert [t for d in paris["paris"] for t in d.token_ids][:7] == PARIS
    assert 0.5 < int8_bytes / bf16_bytes < 0.56, (int8_bytes, bf16_bytes)
