"""LoRA adapters in the engine: parity with transformers + peft, rows of different adapters and of
the base model in one step, slots given in turn, the prefix cache kept apart per adapter, and what
the engine refuses (engine.formats.peft, engine.generate.adapters, engine.layers.lora)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.formats.checkpoint_config import model_info
from engine.formats.peft import read_adapter
from engine.generate.adapters import Adapter, AdapterSlots
from engine.generate.engine import LLMEngine
from engine.generate.request import SamplingParams
from tests.support import parity
from tests.support.parity import (
    assert_all_pages_free,
    hf_greedy,
    make_prompts,
    tokens_of,
)
from tests.support.tiny_models import make_lora_adapter

NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    """Two adapters of the tiny llama: every projection at rank 4; attention only at rank 8 with
    rsLoRA's scale and a per-module alpha."""
    root = tmp_path_factory.mktemp("lora")
    every = make_lora_adapter(llama_dir, root / "every", rank=4, seed=1)
    attention = make_lora_adapter(llama_dir, root / "attention", rank=8, seed=2, alpha=4.0,
                                  targets=("q_proj", "k_proj", "v_proj", "o_proj"), use_rslora=True,
                                  alpha_pattern={"o_proj": 16.0})
    return {"every": every, "attention": attention}


def peft_greedy(model_dir, adapter_dir, prompt: list[int]) -> list[int]:
    return parity.peft_greedy(model_dir, adapter_dir, prompt, NEW_TOKENS)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], str | None]]) -> dict[str, list[int]]:
    for rid, (prompt, adapter) in requests.items():
        engine.add_request(rid, prompt, GREEDY, adapter)
    deltas = {rid: [] for rid in requests}
    while engine.has_work():
        for delta in engine.step():
            deltas[delta.request_id].append(delta)
    return {rid: tokens_of(d) for rid, d in deltas.items()}


def lora_engine(model_dir, adapters, **overrides) -> LLMEngine:
    config = dict(model=str(model_dir), max_num_seqs=4, max_num_batched_tokens=32, page_size=4, num_pages=80,
                  max_model_len=96, warmup=False, max_loras=2, max_lora_rank=8)
    engine = LLMEngine(EngineConfig(**{**config, **overrides}))
    for name, path in adapters.items():
        engine.add_adapter(name, str(path))
    return engine


@pytest.mark.parametrize("backend", ["cpu", "xla", "tpu"])
def test_rows_of_two_adapters_and_the_base_model_in_one_step_equal_transformers_with_peft(llama_dir, adapters,
                                                                                          backend):
    """Base, `every` and `attention` rows share steps; each equals its own reference. The last
    request repeats the base request's prompt with an adapter: the base model's cached pages must
    not serve it."""
    prompts = make_prompts([9, 14, 21, 6])
    requests = {"base": (prompts[0], None), "every": (prompts[1], "every"), "attention": (prompts[2], "attention"),
                "every-2": (prompts[3], "every")}
    engine = lora_engine(llama_dir, adapters, attention_backend=backend)
    got = run(engine, requests)
    assert engine.stats().max_batch_size == 4
    got.update(run(engine, {"same-prompt": (prompts[0], "attention")}))
    assert engine.stats().prefix_cache_hits == 0
    assert got["base"] == hf_greedy(llama_dir, prompts[0], NEW_TOKENS)[0]
    for rid, (prompt, adapter) in {**requests, "same-prompt": (prompts[0], "attention")}.items():
        if adapter is not None:
            assert got[rid] == peft_greedy(llama_dir, adapters[adapter], prompt), rid
    assert got["same-prompt"] != got["base"]
    assert_all_pages_free(engine)


def test_one_slot_serves_two_adapters_in_turn_while_the_base_model_runs_beside(llama_dir, adapters):
    """With one slot, an adapter's requests wait while the other's run; base requests do not wait
    for either. Each adapter is loaded into the slot each time it takes it back."""
    engine = lora_engine(llama_dir, adapters, max_loras=1)
    loads = []
    load = engine.executor.load_adapter
    engine.executor.load_adapter = lambda slot, weights: (loads.append((slot, weights.path)), load(slot, weights))
    prompts = make_prompts([5, 8, 11, 7, 9], seed=3)
    requests = {"a1": (prompts[0], "every"), "b1": (prompts[1], "attention"), "base": (prompts[2], None),
                "a2": (prompts[3], "every"), "b2": (prompts[4], "attention")}
    got = run(engine, requests)
    for rid, (prompt, adapter) in requests.items():
        want = hf_greedy(llama_dir, prompt, NEW_TOKENS)[0] if adapter is None else peft_greedy(
            llama_dir, adapters[adapter], prompt)
        assert got[rid] == want, rid
    assert [slot for slot, _ in loads] == [0, 0]  # every, then attention once every's requests ended
    assert [path for _, path in loads] == [str(adapters["every"]), str(adapters["attention"])]
    assert_all_pages_free(engine)


def test_a_reloaded_adapter_replaces_the_old_one_and_misses_its_cache(llama_dir, adapters):
    engine = lora_engine(llama_dir, adapters)
    prompt = make_prompts([17], seed=5)[0]
    first = run(engine, {"x": (prompt, "every")})["x"]
    engine.add_adapter("every", str(adapters["attention"]))  # same name, other weights
    second = run(engine, {"y": (prompt, "every")})["y"]
    assert first == peft_greedy(llama_dir, adapters["every"], prompt)
    assert second == peft_greedy(llama_dir, adapters["attention"], prompt)
    assert engine.stats().prefix_cache_hits == 0


def test_unknown_and_removed_adapters_are_refused_by_name(llama_dir, adapters):
    engine = lora_engine(llama_dir, adapters)
    assert engine.adapters() == ["attention", "every"]
    assert engine.remove_adapter("every") and not engine.remove_adapter("every")
    with pytest.raises(InvalidRequestError) as caught:
        engine.add_request("r", [5, 6, 7], GREEDY, "every")
    assert caught.value.param == "model"
    assert str(caught.value) == "LoRA adapter 'every' is not loaded; loaded: attention"
    plain = LLMEngine(EngineConfig(model=str(llama_dir), warmup=False, num_pages=40, max_model_len=64))
    with pytest.raises(ValueError, match="serves no LoRA adapters; set max_loras"):
        plain.add_adapter("every", str(adapters["every"]))


def _rewrite_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return dst


def test_adapters_the_engine_cannot_serve_are_refused_with_what_they_ask(llama_dir, adapters, tmp_path,
                                                                         checkpoint_factory):
    info = model_info(llama_dir)
    with pytest.raises(ValueError, match="LoRA rank 8, above max_lora_rank=4; raise max_lora_rank"):
        read_adapter(adapters["attention"], info, max_rank=4)
    for change, message in [(dict(use_dora=True), "DoRA"), (dict(modules_to_save=["lm_head"]), "modules_to_save"),
                            (dict(bias="lora_only"), "trained biases"), (dict(peft_type="IA3"), "peft_type 'IA3'")]:
        bad = _rewrite_config(adapters["every"], tmp_path / message.replace(" ", "_").replace("'", ""), **change)
        with pytest.raises(ValueError, match=f"cannot serve an adapter with .*{message}"):
            read_adapter(bad, info, max_rank=8)
    with pytest.raises(ValueError, match="not a PEFT LoRA adapter: it has no adapter_config.json"):
        read_adapter(llama_dir, info, max_rank=8)
    wider = checkpoint_factory("llama", hidden_size=96)
    with pytest.raises(ValueError, match=r"layer 0 q_proj has factors \(4, 96\) and \(96, 4\); this model's q_proj "
                                         r"needs \(4, 64\) and \(64, 4\) \(an adapter for another model\?\)"):
        read_adapter(make_lora_adapter(wider, tmp_path / "wider"), info, max_rank=8)
    with pytest.raises(ValueError, match="adapts gate_proj, up_proj, down_proj, which this model's layers cannot"):
        read_adapter(adapters["every"], info, max_rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"))


def test_adapter_factors_carry_peft_scales(llama_dir, adapters):
    """rsLoRA scales by alpha / sqrt(rank), alpha_pattern overrides one module; plain LoRA by alpha / rank."""
    from safetensors.numpy import load_file

    info = model_info(llama_dir)
    raw = load_file(str(adapters["attention"] / "adapter_model.safetensors"))
    read = read_adapter(adapters["attention"], info, max_rank=8)
    prefix = "base_model.model.model.layers.1.self_attn"
    np.testing.assert_allclose(read.factors[(1, "q_proj")].b, raw[f"{prefix}.q_proj.lora_B.weight"] * 4 / 8**0.5,
                               rtol=1e-6)
    np.testing.assert_allclose(read.factors[(1, "o_proj")].b, raw[f"{prefix}.o_proj.lora_B.weight"] * 16 / 8**0.5,
                               rtol=1e-6)
    assert read.rank == 8 and read.targets == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert read_adapter(adapters["every"], info, max_rank=8).targets[-1] == "down_proj"


def test_slots_pin_while_running_and_give_way_least_recently_used_first():
    slots = AdapterSlots(2)
    a, b, c = Adapter("a", None), Adapter("b", None), Adapter("c", None)
    assert slots.acquire(a) == (0, True) and slots.acquire(b) == (1, True)
    assert slots.acquire(a) == (0, False)  # resident: no load; pinned twice
    assert not slots.can_acquire(c)
    slots.release(b)
    assert slots.can_acquire(c) and slots.acquire(c) == (1, True)  # b's slot, b unpinned
    slots.release(a), slots.release(a), slots.release(c)
    assert slots.pinned() == 0
    assert slots.acquire(b) == (0, True)  # a was used less recently than c
    with pytest.raises(RuntimeError, match="released more often than acquired"):
        slots.release(a)


def test_a_mixture_of_experts_takes_adapters_on_its_attention(checkpoint_factory, tmp_path):
    """Mixtral: attention adapters served (parity with peft); adapters on the experts refused by name."""
    mixtral = checkpoint_factory("mixtral")
    attention = make_lora_adapter(mixtral, tmp_path / "attention", rank=4, seed=3,
                                  targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    engine = lora_engine(mixtral, {"attention": attention})
    prompt = make_prompts([11], seed=7)[0]
    assert run(engine, {"x": (prompt, "attention")})["x"] == peft_greedy(mixtral, attention, prompt)
    experts = make_lora_adapter(mixtral, tmp_path / "experts", targets=("w1", "w2"))
    with pytest.raises(ValueError, match="block_sparse_moe.experts.0.w1.lora_A.weight' is not a LoRA factor of a "
                                         "layer's projection"):
        engine.add_adapter("experts", str(experts))
