"""The engine against transformers, the reference implementation, on tiny random checkpoints.

Each engine here is configured so that 8 requests must queue (4 sequence slots), must chunk (a
token budget below the longest prompt) and must preempt (a small page pool).
"""

from __future__ import annotations

import contextlib
import logging
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from engine.backends.cpu import kernels as cpu_kernels
from engine.backends.cpu.backend import PackedSwiGLU
from engine.backends.cpu.kernels import FusedLinear
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.generate.engine import LLMEngine
from engine.generate.request import FinishReason, SamplingParams
from tests.support.parity import (
    TIGHT,
    assert_all_pages_free,
    assert_greedy_parity,
    hf_greedy,
    hf_model,
    make_prompts,
    run_to_completion,
    tokens_of,
)


@pytest.mark.parametrize("family,scan_layers,backend", [
    ("llama", False, "cpu"), ("llama", True, "cpu"), ("llama", False, "xla"), ("llama", True, "xla"),
    ("llama", False, "tpu"), ("qwen3", False, "cpu"), ("qwen3", False, "tpu"), ("qwen2", False, "cpu"),
    ("mistral", True, "cpu"), ("olmo2", False, "cpu"), ("olmo2", True, "xla"), ("olmo2", False, "tpu"),
    ("mixtral", False, "cpu"), ("mixtral", True, "xla"), ("mixtral", False, "tpu"), ("gemma2", False, "cpu"),
    ("gemma2", True, "xla"), ("gemma3", False, "cpu"), ("gemma3", True, "xla"), ("phi3", False, "cpu"),
    ("phi3", True, "xla"), ("phi3", False, "tpu")])
def test_greedy_tokens_and_logprobs_equal_transformers(checkpoint_factory, family, scan_layers, backend):
    """cpu: the project's kernels (an AVX2 machine); xla: masked attention in plain JAX; tpu:
    ragged paged attention (levanter's reference implementation off TPU; the Pallas kernel itself in
    tests/unit/test_tpu_kernel.py). Phi-3: fused projections split on load, half of each head rotated,
    and longrope's long factors past 32 tokens (sequences that grow past it recomputed with them)."""
    model_dir = checkpoint_factory(family)
    engine = LLMEngine(EngineConfig(model=str(model_dir), scan_layers=scan_layers, attention_backend=backend,
                                    **TIGHT))
    assert engine.executor.runner.backend.name == backend
    if backend == "cpu":  # q/k/v and gate/up run as one matmul each
        layer = engine.executor.runner.model.first_layer
        assert isinstance(layer.self_attn.q_proj, FusedLinear) and layer.self_attn.k_proj is None
        assert family in ("mixtral", "gemma2", "gemma3") or isinstance(layer.mlp, PackedSwiGLU)  # experts; GELU
    assert_greedy_parity(engine, model_dir)


@pytest.mark.parametrize("wide", [pytest.param(False, id="8-lane"), pytest.param(True, id="16-lane", marks=(
    pytest.mark.skipif(not cpu_kernels.wide_vectors(), reason="needs AVX-512")))])
def test_pages_of_16_tokens_on_the_cpu_kernels_equal_transformers(llama_dir, monkeypatch, wide):
    """The default page size, where the attention kernel runs on 16-lane vectors if the CPU has
    AVX-512 (else, and forced here, on 8-lane ones): queueing, chunking, preemption, prefix hits."""
    monkeypatch.setattr(cpu_kernels, "wide_vectors", lambda: wide)
    engine = LLMEngine(EngineConfig(model=str(llama_dir), attention_backend="cpu",
                                    **{**TIGHT, "page_size": 16, "num_pages": 14}))
    assert_greedy_parity(engine, llama_dir)


@pytest.fixture(scope="module")
def llama_engine(llama_dir):
    return LLMEngine(EngineConfig(model=str(llama_dir), **TIGHT))


def test_seeded_request_is_the_same_alone_and_in_a_batch(llama_engine):
    prompt = make_prompts([11], seed=1)[0]
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = tokens_of(run_to_completion(llama_engine, {"a": (prompt, seeded)})["a"])

    others = {f"o{i}": (p, SamplingParams(max_tokens=20, temperature=0.7 + 0.1 * i, top_k=5 * i, ignore_eos=True))
              for i, p in enumerate(make_prompts([5, 9, 14, 21, 30, 6, 40], seed=2))}
    batched = run_to_completion(llama_engine, {**others, "a": (prompt, seeded)})
    assert tokens_of(batched["a"]) == alone

    other_seed = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=99, ignore_eos=True)
    assert tokens_of(run_to_completion(llama_engine, {"b": (prompt, other_seed)})["b"]) != alone
    assert_all_pages_free(llama_engine)


def test_abort_mid_generation_returns_every_page(llama_engine):
    prompts = make_prompts([10, 20, 30], seed=3)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        llama_engine.add_request(f"r{i}", prompt, params)
    produced = {f"r{i}": 0 for i in range(3)}
    while produced["r1"] < 5:
        for delta in llama_engine.step():
            produced[delta.request_id] += len(delta.token_ids)
    held_before = llama_engine.stats().num_pages - llama_engine.stats().num_free_pages
    pages_of_r1 = len(llama_engine.scheduler.running[1].pages)
    llama_engine.abort("r1")
    assert llama_engine.stats().num_pages - llama_engine.stats().num_free_pages == held_before - pages_of_r1
    final = [d for d in llama_engine.step() if d.request_id == "r1"]
    assert [(d.token_ids, d.finish_reason) for d in final] == [([], FinishReason.ABORT)]
    llama_engine.abort("r0")
    llama_engine.abort("r2")
    while llama_engine.has_work():
        llama_engine.step()
    assert_all_pages_free(llama_engine)


def test_n4_siblings_share_their_prompt_pages(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=4, max_num_batched_tokens=64,
                                    prefill_chunk=32, page_size=4, num_pages=64, max_model_len=64, warmup=False))
    prompt = make_prompts([14], seed=4)[0]  # 3 full pages + 2 tokens
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"s{i}", prompt, params)
    for _ in range(4):  # 14-token prompts under a 64-token budget: all four run after the first step
        engine.step()
        if len(engine.scheduler.running) == 4:
            break
    pages = [seq.pages for seq in engine.scheduler.running]
    assert len(pages) == 4
    assert all(p[:3] == pages[0][:3] for p in pages), "siblings hold the same three prompt pages"
    assert [engine.allocator.ref_count(page) for page in pages[0][:3]] == [4, 4, 4]
    assert len({p[3] for p in pages}) == 4, "each sibling writes its own last, partial page"
    assert engine.stats().prefix_cache_hits == 3 * 12
    while engine.has_work():
        engine.step()
    assert_all_pages_free(engine)


def test_repeated_prefix_is_served_from_cache_with_identical_output(llama_engine):
    prompt = make_prompts([13], seed=5)[0]  # 3 full pages of 4 + 1 token
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    first = run_to_completion(llama_engine, {"p1": (prompt, params)})["p1"]
    hits_before = llama_engine.stats().prefix_cache_hits
    second = run_to_completion(llama_engine, {"p2": (prompt, params)})["p2"]
    assert llama_engine.stats().prefix_cache_hits - hits_before == 12
    assert second[0].num_cached_tokens == 12 and first[0].num_cached_tokens == 0
    assert tokens_of(second) == tokens_of(first)
    assert_all_pages_free(llama_engine)


def test_prompt_logprobs_equal_transformers(llama_engine, llama_dir):
    prompt = make_prompts([21], seed=6)[0]
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    deltas = run_to_completion(llama_engine, {"e": (prompt, params)})["e"]
    got = deltas[0].prompt_logprobs
    assert got[0] is None and len(got) == len(prompt)
    logits = hf_model(str(llama_dir))(torch.tensor([prompt])).logits[0]
    want = torch.log_softmax(logits, -1)
    for i in range(1, len(prompt)):
        assert got[i].token_id == prompt[i]
        assert abs(got[i].logprob - want[i - 1, prompt[i]].item()) < 1e-3
        top = torch.topk(want[i - 1], 2)
        assert [t for t, _ in got[i].top] == top.indices.tolist()


def test_stop_token_ids_min_tokens_and_eos(llama_engine):
    prompt = make_prompts([9], seed=7)[0]
    free_run = tokens_of(run_to_completion(
        llama_engine, {"f": (prompt, SamplingParams(max_tokens=20, ignore_eos=True))})["f"])
    stop_at = free_run[5]
    first_index = free_run.index(stop_at)
    stopped = run_to_completion(llama_engine, {"s": (prompt, SamplingParams(max_tokens=20, stop_token_ids=(stop_at,)))})
    assert tokens_of(stopped["s"]) == free_run[: first_index + 1]
    assert stopped["s"][-1].finish_reason is FinishReason.STOP
    # min_tokens blocks the stop token until that many tokens exist
    late = run_to_completion(llama_engine, {"m": (prompt, SamplingParams(max_tokens=20, min_tokens=first_index + 2,
                                                                          stop_token_ids=(stop_at,)))})
    late_tokens = tokens_of(late["m"])
    assert stop_at not in late_tokens[: first_index + 2]
    assert late_tokens[: first_index] == free_run[:first_index]
    assert_all_pages_free(llama_engine)


def test_repetition_penalty_equals_transformers(llama_engine, llama_dir):
    prompt = make_prompts([15], seed=8)[0]
    params = SamplingParams(max_tokens=16, repetition_penalty=1.5, ignore_eos=True)
    got = tokens_of(run_to_completion(llama_engine, {"rp": (prompt, params)})["rp"])
    want, _ = hf_greedy(llama_dir, prompt, 16, repetition_penalty=1.5)
    assert got == want


def test_logit_bias_forces_a_token_and_top_k_1_is_greedy(llama_engine):
    prompt = make_prompts([6], seed=9)[0]
    forced = run_to_completion(llama_engine, {"b": (prompt, SamplingParams(max_tokens=5, logit_bias=((42, 100.0),),
                                                                           ignore_eos=True))})["b"]
    assert tokens_of(forced) == [42] * 5
    greedy = tokens_of(run_to_completion(llama_engine, {"g": (prompt, SamplingParams(max_tokens=8, ignore_eos=True))})["g"])
    top1 = run_to_completion(llama_engine, {"k": (prompt, SamplingParams(max_tokens=8, temperature=2.0, top_k=1,
                                                                         seed=5, ignore_eos=True))})["k"]
    assert tokens_of(top1) == greedy


def test_async_scheduling_gives_the_output_of_one_step_at_a_time(llama_dir):
    """Planning step N+1 while step N runs changes nothing a client sees: the same tokens,
    logprobs and finish reasons as a step-by-step engine, through early stops (the extra row in
    flight is dropped), seeded sampling, prompt logprobs, penalties (which pause the overlap),
    chunking and preemption; and every page comes back."""
    overlapped = LLMEngine(EngineConfig(model=str(llama_dir), **TIGHT))
    stepwise = LLMEngine(EngineConfig(model=str(llama_dir), async_scheduling=False, **TIGHT))
    prompts = make_prompts([50, 33, 40, 28, 7, 12, 20, 9, 13, 13], seed=11)  # the first four overflow the pool
    free = {"f": (prompts[5], SamplingParams(max_tokens=30, ignore_eos=True))}
    free_run = tokens_of(run_to_completion(overlapped, free)["f"])
    assert tokens_of(run_to_completion(stepwise, free)["f"]) == free_run
    requests = {str(i): (p, SamplingParams(max_tokens=40, ignore_eos=True)) for i, p in enumerate(prompts)}
    requests["5"] = (prompts[5], SamplingParams(max_tokens=30, stop_token_ids=(free_run[4],)))
    requests["6"] = (prompts[6], SamplingParams(max_tokens=25, temperature=1.0, top_p=0.9, seed=7, logprobs=2))
    requests["7"] = (prompts[7], SamplingParams(max_tokens=6, prompt_logprobs=1, ignore_eos=True))
    requests["8"] = (prompts[8], SamplingParams(max_tokens=20, presence_penalty=1.5, ignore_eos=True))
    requests["9"] = (prompts[9], SamplingParams(max_tokens=1, ignore_eos=True))

    want = run_to_completion(stepwise, requests)
    got = run_to_completion(overlapped, requests)

    def seen(deltas):  # logprob values apart: batches differ, and with them XLA's float sums
        def lps(logprobs):
            return [None if lp is None else (lp.token_id, [t for t, _ in lp.top]) for lp in logprobs or []]
        return [(d.token_ids, lps(d.logprobs), d.finish_reason, d.num_prompt_tokens, d.num_cached_tokens,
                 lps(d.prompt_logprobs)) for d in deltas]

    def logprob_values(deltas):
        return [lp.logprob for d in deltas for lp in (d.logprobs or []) + (d.prompt_logprobs or []) if lp]

    for rid in requests:
        assert seen(got[rid]) == seen(want[rid]), f"request {rid}"
        np.testing.assert_allclose(logprob_values(got[rid]), logprob_values(want[rid]), atol=1e-4)
    assert got["5"][-1].finish_reason is FinishReason.STOP
    assert len(tokens_of(got["5"])) == free_run.index(free_run[4]) + 1
    assert overlapped.stats().num_preemptions > 0, "the page pool is small enough to preempt"
    assert_all_pages_free(overlapped)
    assert_all_pages_free(stepwise)


def test_async_scheduling_keeps_one_step_in_flight(llama_engine):
    """A step's tokens arrive with the next step() call, which has launched its successor."""
    prompt = make_prompts([5], seed=12)[0]
    llama_engine.add_request("x", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    batches = []
    while llama_engine.has_work():
        batches.append([len(d.token_ids) for d in llama_engine.step()])
    assert batches == [[], [1], [1], [1]]  # launch 1; launch 2, fetch 1; launch 3, fetch 2; fetch 3
    assert_all_pages_free(llama_engine)


def test_requests_that_cannot_fit_are_refused_with_the_numbers(llama_engine):
    with pytest.raises(InvalidRequestError, match=r"maximum context length is 128 tokens.*130 tokens \(30 in the "
                                                  r"prompt, 100 for the completion\)"):
        llama_engine.add_request("long", list(range(3, 33)), SamplingParams(max_tokens=100))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llama_engine.add_request("oov", [1, 10_000], SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        llama_engine.add_request("empty", [], SamplingParams())
    assert not llama_engine.has_work()


def test_a_relative_checkpoint_path_loads_offline(llama_dir, llama_engine, monkeypatch):
    monkeypatch.chdir(llama_dir.parent)
    engine = LLMEngine(EngineConfig(model=llama_dir.name, **TIGHT))
    prompt = make_prompts([7], seed=10)[0]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    relative = tokens_of(run_to_completion(engine, {"rel": (prompt, params)})["rel"])
    assert relative == tokens_of(run_to_completion(llama_engine, {"abs": (prompt, params)})["abs"])


def test_bfloat16_without_the_cpu_kernels_warns_on_cpu(llama_dir, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="engine.backends.select"):
        LLMEngine(EngineConfig(model=str(llama_dir), dtype="bfloat16", attention_backend="xla", **TIGHT))
    assert any("set dtype: float32" in r.message for r in caplog.records)


def test_step_plans_carry_everything_the_device_side_needs(llama_dir, llama_engine, monkeypatch):
    """Every step plan goes through pickle before the runner sees it (what a leader sends to its
    hosts): the answers equal those of the engine that hands plans over in memory."""
    import pickle

    engine = LLMEngine(EngineConfig(model=str(llama_dir), **TIGHT))
    launch, seen = engine.executor.launch, []

    def launch_a_copy(plan, sample=True):
        seen.append(plan.step_id)
        return launch(pickle.loads(pickle.dumps(plan)), sample)

    monkeypatch.setattr(engine.executor, "launch", launch_a_copy)
    requests = {str(i): (p, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1))
                for i, p in enumerate(make_prompts([9, 30, 4], seed=14))}
    requests["s"] = (make_prompts([6], seed=15)[0], SamplingParams(max_tokens=10, temperature=1.0, seed=3))
    got, want = run_to_completion(engine, requests), run_to_completion(llama_engine, requests)
    assert len(seen) > 10
    for rid in requests:
        assert tokens_of(got[rid]) == tokens_of(want[rid])
    assert_all_pages_free(engine)


def test_dtype_auto_serves_a_checkpoint_in_its_own_dtype(checkpoint_factory, llama_engine):
    bf16 = LLMEngine(EngineConfig(model=str(checkpoint_factory("llama", dtype="bfloat16")), **TIGHT))
    assert bf16.describe()["dtype"] == bf16.describe()["kv_cache_dtype"] == "bfloat16"
    down = bf16.executor.runner.model.first_layer.mlp.down_proj
    assert {layout.dtype for layout in (down.weight, down.plain) if layout is not None} == {jnp.dtype(jnp.bfloat16)}
    assert llama_engine.describe()["dtype"] == "float32"  # the float32 checkpoint
    tokens = tokens_of(run_to_completion(bf16, {"b": (make_prompts([9], seed=16)[0], SamplingParams(max_tokens=4))})["b"])
    assert len(tokens) == 4


@pytest.mark.parametrize("declared,served", [("bfloat16", "bfloat16"), ("float16", "bfloat16"),
                                             ("float32", "float32"), (None, "float32")])
def test_thedeclared_dtype_decides_auto(declared, served):
    from engine.formats.checkpoint_config import declared_dtype

    assert declared_dtype({} if declared is None else {"torch_dtype": declared}) == served
    assert declared_dtype({"dtype": declared} if declared else {}) == served  # transformers 5's key


def test_the_kv_pool_takes_its_share_of_the_memory_the_weights_leave(llama_dir, monkeypatch, caplog):
    """On an accelerator (faked: the device reports 1 MiB free), num_pages 0 sizes the pool from
    memory: a page of the tiny model is 2 layers x 4 slots x 2 KV heads x 16 x (K, V) x 4 bytes."""
    import logging

    from engine.generate.runner import memory_plan, sharding

    monkeypatch.setattr(sharding, "free_device_memory", lambda devices: 2**20)
    config = {**TIGHT, "num_pages": 0, "kv_cache_memory_fraction": 0.5}
    with caplog.at_level(logging.INFO, logger="engine.generate.runner.kv_pool"):
        engine = LLMEngine(EngineConfig(model=str(llama_dir), **config))
    assert engine.executor.facts.num_pages == 2**19 // 2048 == 256
    assert engine.stats().num_pages == 255  # the scratch page is not for requests
    assert "KV pool: 256 pages of 4 tokens (1024 tokens, 0.00 GiB per device) from 50% of 0.00 GiB free" in caplog.text
    # room for the weights and 16 pages: refused before loading (engine.generate.runner.memory_plan), saying why
    weights = memory_plan.plan(EngineConfig(model=str(llama_dir), **config), 1, 2**20).weight_bytes
    monkeypatch.setattr(sharding, "free_device_memory", lambda devices: weights + 32 * 2048)
    with pytest.raises(ValueError, match=r"the KV pool holds 16 pages of 4 tokens, fewer than one sequence of "
                                         r"max_model_len=128 needs \(33\); lower max_model_len"):
        LLMEngine(EngineConfig(model=str(llama_dir), **config))


@pytest.mark.parametrize("cpu_matmul", ["kernel", "xla", "xla_f32", "auto"])
def test_parity_holds_whichever_matmul_each_shape_runs(checkpoint_factory, monkeypatch, cpu_matmul):
    """kernel / xla / xla_f32 force one path for every product; auto, with a fake timer that makes XLA's dot
    faster from 16 rows on, mixes them: the layers of the 16- and 24-token buckets on XLA's dot, the
    1- and 8-token buckets and the LM head (at most 4 rows) on the kernel; each module then holds
    the layouts its products read. (A vocabulary of 512 ids, so that the LM head is packed too.)"""
    from engine.backends.cpu import matmul_choice

    llama_dir = checkpoint_factory("llama", vocab_size=512)
    def timer(product, path, bound=None):
        return 1.0 if (path == "xla") == (product.rows >= 16) else 2.0

    monkeypatch.setattr(matmul_choice, "time_product", timer)
    engine = LLMEngine(EngineConfig(model=str(llama_dir), attention_backend="cpu", cpu_matmul=cpu_matmul,
                                    compilation_cache_dir=None, **{**TIGHT, "warmup": True}))
    layer_rows = {b.tokens for b in engine.executor.facts.buckets.all()}
    on_xla = cpu_matmul in ("xla", "xla_f32")
    want = {"kernel": frozenset(), "auto": frozenset({16, 24})}.get(cpu_matmul, frozenset(layer_rows))
    layer = engine.executor.runner.model.first_layer
    assert layer_rows == {1, 8, 16, 24}
    assert layer.self_attn.q_proj.xla_rows == layer.self_attn.o_proj.xla_rows == layer.mlp.gate_up.xla_rows == want
    head = engine.executor.runner.model.lm_head
    assert head.xla_rows == (frozenset({b.samples for b in engine.executor.facts.buckets.all()}) if on_xla
                             else frozenset())
    assert head.f32_rows == (head.xla_rows if cpu_matmul == "xla_f32" else frozenset())
    # each module holds the layouts its products read: panels (kernel), the plain matrix (XLA), or both
    for module in (layer.self_attn.q_proj, layer.mlp.gate_up, head):
        assert (module.weight is not None, module.plain is not None) == (not on_xla, bool(module.xla_rows))
    assert_greedy_parity(engine, llama_dir)


def test_xla_dot_in_float32_computes_the_kernels_arithmetic_on_bfloat16_weights(checkpoint_factory, monkeypatch,
                                                                                  caplog):
    """bfloat16 weights: the products auto times as fastest in float32 (the 16- and 24-token buckets,
    with a fake timer and widening timed from 16 rows) widen the weight in the step and keep the
    activations float32, as the kernel does; so every greedy token equals the kernel-only engine's
    and every logprob is within 1e-4 (summation order). The modules read both layouts. A host whose
    available memory could not hold a step's widened weights gets XLA's bf16 dot instead."""
    from engine.backends.cpu import matmul_choice

    llama_dir = checkpoint_factory("llama", vocab_size=512)
    monkeypatch.setattr(matmul_choice, "WIDEN_FROM_ROWS", 16)
    def timer(product, path, bound=None):  # the kernel below 16 rows; from 16, XLA's fp32 dot, then its bf16 one
        return {"kernel": 1.0, "xla": 2.0}[path] if product.rows < 16 else {"xla_f32": 1.0, "xla": 1.5}.get(path, 2.0)

    monkeypatch.setattr(matmul_choice, "time_product", timer)
    prompts = make_prompts()
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=0)
    outputs = {}
    for cpu_matmul in ("kernel", "auto"):
        engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="bfloat16", attention_backend="cpu",
                                        cpu_matmul=cpu_matmul, compilation_cache_dir=None,
                                        **{**TIGHT, "warmup": True}))
        try:
            outputs[cpu_matmul] = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
            layer = engine.executor.runner.model.first_layer
            want = frozenset({16, 24}) if cpu_matmul == "auto" else frozenset()
            for module in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_up):
                assert module.xla_rows == module.f32_rows == want
                assert module.weight is not None and (module.plain is not None) == bool(want)
                assert module.weight.dtype == jnp.bfloat16
        finally:
            engine.shutdown()
    # where a step's widened weights would not fit a quarter of the available memory, the fp32 dot is not chosen
    from engine.backends.cpu import backend as cpu_backend

    monkeypatch.setattr(cpu_backend, "_available_memory", lambda: 2**20)
    with caplog.at_level(logging.INFO, logger="engine.backends.cpu.backend"):
        engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="bfloat16", attention_backend="cpu",
                                        compilation_cache_dir=None, **{**TIGHT, "warmup": True}))
    gate_up = engine.executor.runner.model.first_layer.mlp.gate_up
    assert (gate_up.xla_rows, gate_up.f32_rows) == (frozenset({16, 24}), frozenset())
    assert "XLA's dot in float32 is not considered: a step widening every weight would hold" in caplog.text
    engine.shutdown()
    for i in range(len(prompts)):
        kernel, wide = outputs["kernel"][str(i)], outputs["auto"][str(i)]
        assert tokens_of(wide) == tokens_of(kernel), f"prompt {i}"
        np.testing.assert_allclose([lp.logprob for d in wide for lp in d.logprobs],
                                   [lp.logprob for d in kernel for lp in d.logprobs], atol=1e-4)


@contextlib.contextmanager
def recorded_compiles():
    """The misses in jit's own cache while the block runs (each trace and each backend compile),
    whether or not the persistent compilation cache then has the executable."""
    import jax.monitoring

    compiles = []

    def on_event(event: str, seconds: float, **_) -> None:
        if event in ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration"):
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)


def test_requests_sent_while_programs_compile_are_answered_from_the_ready_ones(llama_dir, monkeypatch):
    """With the background compiler held after the first program (8 tokens: the full decode batch
    of 4 fits), every step takes that bucket, so a 30-token prompt is read 8 tokens at a time, and
    the answers equal transformers'. Nothing compiles meanwhile: the first program's sampler variants
    cover greedy and random sampling (a seeded request beside them). Released, the rest compile, and
    a later request's prompt is read in one step of the 24-token program, its logits computed for one row."""
    import threading

    from engine import compiler
    from engine.step.buckets import Bucket

    release, compile_rest = threading.Event(), compiler.StepCompiler._compile_rest
    monkeypatch.setattr(compiler.StepCompiler, "_compile_rest",
                        lambda self, lower_priority=True: release.wait(600) and compile_rest(self, lower_priority))
    engine = LLMEngine(EngineConfig(model=str(llama_dir), compilation_cache_dir=None, **{**TIGHT, "warmup": True}))
    assert (engine.stats().compiled_programs, engine.stats().step_programs) == (1, 4)
    build, buckets = engine.planner.build, []

    def spy(*args, **kwargs):
        step, slots = build(*args, **kwargs)
        buckets.append(step.bucket)
        return step, slots

    monkeypatch.setattr(engine.planner, "build", spy)
    prompts = make_prompts([30, 5], seed=21)
    greedy, seeded = SamplingParams(max_tokens=8, ignore_eos=True), SamplingParams(max_tokens=8, temperature=0.8, seed=5)
    with recorded_compiles() as compiles:
        got = run_to_completion(engine, {**{str(i): (p, greedy) for i, p in enumerate(prompts)},
                                         "seeded": (prompts[1], seeded)})
    assert compiles == []
    assert set(buckets) == {Bucket(8, 4)} and len(buckets) >= 4 + 7  # 30 + 5 prompt tokens in pieces of 8
    for i, prompt in enumerate(prompts):
        assert tokens_of(got[str(i)]) == hf_greedy(llama_dir, prompt, 8)[0]
    release.set()
    assert engine.wait_until_compiled(timeout=600) and engine.stats().compiled_programs == 4
    buckets.clear()
    run_to_completion(engine, {"late": (make_prompts([22], seed=22)[0], greedy)})
    assert buckets[0] == Bucket(24, 1) and set(buckets[1:]) == {Bucket(1, 1)}  # one row of logits for the prompt
    assert_all_pages_free(engine)


def test_without_warm_up_nothing_is_compiled_ahead_and_nothing_is_waited_for(llama_engine):
    """warmup off: every bucket may be taken (each compiles on first use), no progress is
    reported, and waiting for the compiles returns at once."""
    assert llama_engine.executor.ready_buckets() == llama_engine.executor.facts.buckets.all()
    assert (llama_engine.stats().compiled_programs, llama_engine.stats().step_programs) == (0, 0)
    assert llama_engine.wait_until_compiled() is False


def test_after_the_background_compiles_serving_compiles_nothing(llama_dir):
    """Every bucket is compiled (the first before the engine returns, the rest in the background)
    with the arguments' types a real step passes (the previous step's tokens included), so once the
    last is in, requests wait for no compiler. A trace is a miss in jit's own cache, whether or not
    the persistent compilation cache then has the executable."""
    engine = LLMEngine(EngineConfig(model=str(llama_dir), **{**TIGHT, "warmup": True}))
    assert engine.wait_until_compiled(timeout=600)
    assert engine.stats().compiled_programs == engine.stats().step_programs == 4
    with recorded_compiles() as compiles:
        greedy = SamplingParams(max_tokens=6, ignore_eos=True)
        run_to_completion(engine, {f"r{i}": (p, greedy) for i, p in enumerate(make_prompts([3, 9, 30, 17, 5]))})
        # the variants the first program left to the background: random with logprobs, over 4 rows too
        seeded = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=1, logprobs=1)
        run_to_completion(engine, {f"s{i}": (p, seeded) for i, p in enumerate(make_prompts([3, 9, 30, 17, 5]))})
    assert compiles == []
    assert_all_pages_free(engine)


def test_a_process_exiting_mid_compile_finishes_that_program_and_compiles_no_more(llama_dir):
    """A replica stopped while its programs compile in the background (a scale-down right after a
    scale-up): at exit the compile in progress completes before jax's own exit handler clears the
    backends under it, nothing after it starts, and the process exits cleanly. The compile thread is
    held inside its first background program until the interpreter has begun to exit."""
    import subprocess
    import sys

    config = {**TIGHT, "warmup": True}
    code = f"""
import atexit, logging, sys, threading
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from engine.config import EngineConfig
from engine.generate.engine import LLMEngine
from engine import compiler

inside, exiting, compile_bucket = threading.Event(), threading.Event(), compiler.StepCompiler._compile
def held(self, bucket):
    if threading.current_thread().name == "step-compiler" and not inside.is_set():
        inside.set()
        exiting.wait()
    compile_bucket(self, bucket)
compiler.StepCompiler._compile = held
engine = LLMEngine(EngineConfig(model={str(llama_dir)!r}, **{config!r}))
inside.wait()
atexit.register(exiting.set)  # registered last, so run first at exit
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "USE_TORCH": "0"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compiling a step program failed" not in run.stderr, run.stderr[-3000:]
    assert "step program 2/4" in run.stderr and "step program 3/4" not in run.stderr, run.stderr[-3000:]


def test_a_url_compilation_cache_goes_to_jax_as_it_is(tmp_path, monkeypatch):
    """A local path is expanded and made; a URL (a cache the hosts of a slice share) is JAX's to
    open, and no local directory named after it appears."""
    import jax

    from engine import compiler

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    before = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        compiler.enable_compilation_cache("gs://bucket/xla")
        assert jax.config.jax_compilation_cache_dir == "gs://bucket/xla"
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.5  # a read is a round trip
        assert list(tmp_path.iterdir()) == []
        compiler.enable_compilation_cache("~/xla")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla") and (tmp_path / "xla").is_dir()
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])


def test_a_local_compilation_cache_keeps_the_smallest_programs_too(tmp_path):
    """Loading and packing weights run many tiny programs once each; a local cache keeps them, so
    a restart reads them back instead of compiling them again (a fresh process, as a replica is)."""
    import subprocess
    import sys

    code = ("import jax, jax.numpy as jnp; from engine.compiler import enable_compilation_cache; "
            f"enable_compilation_cache({str(tmp_path)!r}); jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "jit__lambda" in {p.name.split("-")[0] for p in tmp_path.iterdir() if p.name.endswith("-cache")}


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_mistral_over_a_sliding_window_answers_as_transformers_does(tmp_path, checkpoint_factory, backend):
    """Every layer attends over the last 16 tokens; the parity prompts run to 50 tokens and more."""
    import json
    import shutil

    model_dir = tmp_path / "mistral-window"
    shutil.copytree(checkpoint_factory("mistral"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "sliding_window": 16}))
    engine = LLMEngine(EngineConfig(model=str(model_dir), attention_backend=backend, **TIGHT))
    assert engine.executor.runner.model.variant.sliding_layers == (True, True)
    assert_greedy_parity(engine, model_dir)


def test_layer_types_the_engine_does_not_run_are_refused_by_name(tmp_path, llama_dir):
    import json
    import shutil

    model_dir = tmp_path / "chunked"
    shutil.copytree(llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "layer_types": ["chunked_attention"] * 2}))
    with pytest.raises(ValueError, match="config.json's layer_types has chunked_attention; the engine runs "
                                         "full_attention and sliding_attention layers"):
        LLMEngine(EngineConfig(model=str(model_dir), warmup=False))
