"""LoRA under tensor parallelism on host CPU devices: each adapter's factors split as the weights
they adapt, and the adapted rows answer as transformers + peft does (KV heads repeated at TP 4)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.generate.engine import LLMEngine
from engine.generate.request import SamplingParams
from tests.support.parity import hf_greedy, make_prompts, peft_greedy
from tests.support.tiny_models import make_lora_adapter

EIGHT_HEADS = dict(hidden_size=128, num_heads=8, num_kv_heads=2, intermediate_size=256)


@pytest.mark.parametrize("tp,sizes", [(2, {}), (4, EIGHT_HEADS)], ids=["tp2", "8q2kv-tp4"])
def test_adapted_rows_split_over_devices_equal_transformers_with_peft(checkpoint_factory, tmp_path, tp, sizes):
    model_dir = checkpoint_factory("llama", **sizes)
    every = make_lora_adapter(model_dir, tmp_path / "every", rank=4, seed=1)
    attention = make_lora_adapter(model_dir, tmp_path / "attention", rank=8, seed=2,
                                  targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    engine = LLMEngine(EngineConfig(model=str(model_dir), tensor_parallel_size=tp, max_num_seqs=4,
                                    max_num_batched_tokens=32, page_size=4, num_pages=80, max_model_len=96,
                                    warmup=False, max_loras=2, max_lora_rank=8))
    engine.add_adapter("every", str(every))
    engine.add_adapter("attention", str(attention))
    pool = engine.executor.runner.lora
    q_b, down_a = pool.b["q_proj"], pool.a["down_proj"]
    assert {s.data.shape for s in q_b.array.addressable_shards} == {q_b.array.shape[:3] + (
        q_b.array.shape[3] // tp, *q_b.array.shape[4:])}  # kv_head split
    assert len({s.data.shape for s in down_a.array.addressable_shards}) == 1
    assert down_a.array.addressable_shards[0].data.shape[2] == down_a.array.shape[2] // tp  # mlp split

    prompts = make_prompts([9, 14, 21], seed=4)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    adapters = [None, "every", "attention"]
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        engine.add_request(str(i), prompt, params, adapter)
    got = {str(i): [] for i in range(3)}
    while engine.has_work():
        for delta in engine.step():
            got[delta.request_id] += delta.token_ids
    assert got["0"] == hf_greedy(model_dir, prompts[0], 10)[0]
    assert got["1"] == peft_greedy(model_dir, every, prompts[1], 10)
    assert got["2"] == peft_greedy(model_dir, attention, prompts[2], 10)
