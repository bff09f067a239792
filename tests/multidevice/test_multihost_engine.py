"""One engine over two host processes: the leader (this process) schedules; two `EngineWorker`
Ray actors, 2 host CPU devices each, form one jax.distributed job (gloo collectives) and hold a
Llama with 8 query / 2 KV heads split over all 4 devices (and one LoRA slot: base rows must not
notice it)."""

from __future__ import annotations

import json

import pytest
import ray
from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.generate.engine import LLMEngine
from engine.generate.planner import empty_step_plan
from engine.generate.request import Grammar, SamplingParams
from tests.support.parity import (
    TIGHT,
    assert_greedy_parity,
    make_prompts,
    peft_greedy,
    run_to_completion,
    tokens_of,
)
from tests.support.serving_helpers import engine_worker_processes
from tests.support.tiny_models import make_lora_adapter

WORKER_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1",
              "USE_TORCH": "0"}  # as deploy/config.yaml: the workers run no torch model


@pytest.fixture(scope="module")
def two_hosts(checkpoint_factory):
    model_dir = checkpoint_factory("llama", hidden_size=128, num_heads=8, num_kv_heads=2, intermediate_size=256)
    ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env={"env_vars": WORKER_ENV})
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_hosts=2, tensor_parallel_size=4, max_loras=1,
                                    max_lora_rank=4, compilation_cache_dir=None, **{**TIGHT, "warmup": True}))
    yield engine, model_dir
    engine.shutdown()
    ray.shutdown()


def test_greedy_tokens_and_logprobs_equal_transformers_over_two_hosts(two_hosts):
    engine, model_dir = two_hosts
    described = engine.describe()
    assert {k: described[k] for k in ("num_hosts", "tensor_parallel_size", "num_devices", "mesh")} == {
        "num_hosts": "2", "tensor_parallel_size": "4", "num_devices": "4", "mesh": "data=1,model=4"}
    assert_greedy_parity(engine, model_dir)


def test_both_hosts_compile_the_same_programs_in_the_same_order(two_hosts):
    engine, _ = two_hosts
    assert engine.wait_until_compiled(timeout=600)
    order = [repr(bucket) for bucket in engine.executor.facts.buckets.compile_order()]
    assert engine.executor.compiled_programs() == [order, order]
    assert engine.stats().compiled_programs == engine.stats().step_programs == len(order) == 4


def test_a_constrained_request_samples_after_its_forward_pass_on_every_host(two_hosts):
    """Async scheduling defers a constrained step's sampling until its grammar's mask is known:
    a second call to every worker. The JSON is valid and equal to the one-process engine's."""
    engine, model_dir = two_hosts
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=5, grammar=Grammar("json_schema", json.dumps(schema)))
    prompt = make_prompts([11], seed=4)[0]
    two = tokens_of(run_to_completion(engine, {"c": (prompt, params)})["c"])
    one = LLMEngine(EngineConfig(model=str(model_dir), compilation_cache_dir=None, **TIGHT))
    assert two == tokens_of(run_to_completion(one, {"c": (prompt, params)})["c"])
    text = AutoTokenizer.from_pretrained(str(model_dir)).decode(two, skip_special_tokens=True)
    assert set(json.loads(text)) == {"n", "ok"}


def test_two_engine_worker_processes_hold_the_model(two_hosts):
    engine, _ = two_hosts
    pids = set(engine.executor.worker_pids)  # other Ray instances on this machine may run workers too
    assert len(pids) == 2 and pids <= {p.pid for p in engine_worker_processes()}


def test_a_host_given_another_bucket_than_its_peers_refuses_the_step(two_hosts):
    """Each host compares the plan's fingerprint with its peers' before running it: a host that
    would compile another program fails loudly instead of computing garbage with the others."""
    engine, _ = two_hosts
    first, other = engine.executor.facts.buckets.all()[:2]
    plans = [empty_step_plan(first, engine.executor.facts.buckets, step_id=10**6),
             empty_step_plan(other, engine.executor.facts.buckets, step_id=10**6)]
    calls = [worker.launch.remote(plan) for worker, plan in zip(engine.executor.workers, plans)]
    for call in calls:
        with pytest.raises(ray.exceptions.RayTaskError, match="must run identical steps in identical order"):
            ray.get(call, timeout=60)


def test_lora_adapters_load_on_every_host_and_answer_as_transformers_with_peft(two_hosts, tmp_path):
    """Two adapters take the one slot in turn: each load reaches both workers between steps."""
    engine, model_dir = two_hosts
    adapters = {name: make_lora_adapter(model_dir, tmp_path / name, rank=4, seed=seed)
                for name, seed in (("a", 1), ("b", 2))}
    for name, path in adapters.items():
        engine.add_adapter(name, str(path))
    prompts = make_prompts([9, 13], seed=11)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for name, prompt in zip(adapters, prompts):
        engine.add_request(name, prompt, params, name)
    got = {name: [] for name in adapters}
    while engine.has_work():
        for delta in engine.step():
            got[delta.request_id] += delta.token_ids
    for name, prompt in zip(adapters, prompts):
        assert got[name] == peft_greedy(model_dir, adapters[name], prompt, 8), name


def test_images_reach_every_host_and_answer_as_transformers_llava(two_hosts, tmp_path):
    """A LLaVA decoder over the two hosts: each image's pixels go to both workers, which compute its
    features into its slot between steps; a request that waits for the one slot gets it after the
    first ends. Greedy tokens of each prompt equal LlavaForConditionalGeneration's."""
    import numpy as np
    import torch
    import transformers

    from engine.formats.model_sources import resolve_model
    from engine.generate.images import ImageInput
    from serve_app.media.images import content_hash
    from tests.support.tiny_models import make_llava_checkpoint

    checkpoint = make_llava_checkpoint(tmp_path / "llava")
    engine = LLMEngine(EngineConfig(model=str(resolve_model(str(checkpoint), cache_dir=tmp_path / "cache")),
                                    num_hosts=2, tensor_parallel_size=4, image_slots=1, compilation_cache_dir=None,
                                    **{**TIGHT, "max_model_len": 160, "num_pages": 120}))
    try:
        images = [np.random.default_rng(seed).standard_normal((3, 32, 32)).astype(np.float32) for seed in (1, 2)]
        placeholder = [engine.image_token_id] * engine.images.tokens_per_image
        prompts = [text[:3] + placeholder + text[3:] for text in make_prompts([10, 14], vocab=300, seed=5)]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for i, (prompt, pixels) in enumerate(zip(prompts, images)):
            engine.add_request(str(i), prompt, params, images=(ImageInput(content_hash(pixels), pixels),))
        got = {"0": [], "1": []}
        while engine.has_work():
            for delta in engine.step():
                got[delta.request_id] += delta.token_ids
    finally:
        engine.shutdown()
    reference = transformers.LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for i, (prompt, pixels) in enumerate(zip(prompts, images)):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), pixel_values=torch.tensor(pixels[None]),
                                          max_new_tokens=8, do_sample=False, eos_token_id=None,
                                          pad_token_id=0)[0, len(prompt):].tolist()
        assert got[str(i)] == expected, i


def test_a_mixture_of_experts_split_whole_over_two_hosts_answers_as_transformers(two_hosts, checkpoint_factory):
    """A Qwen3-MoE over the two hosts with expert parallelism (its 8 experts, 2 on each of the 4
    devices; each device runs the rows routed to its own and the sums meet in one all-reduce over
    gloo): greedy tokens and logprobs equal transformers'."""
    model_dir = checkpoint_factory("qwen3_moe", hidden_size=128, num_heads=8, num_kv_heads=2, intermediate_size=256)
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_hosts=2, tensor_parallel_size=4, expert_parallel_size=4,
                                    compilation_cache_dir=None, **TIGHT))
    try:
        assert_greedy_parity(engine, model_dir)
    finally:
        engine.shutdown()
