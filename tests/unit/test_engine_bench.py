"""benchmarks/engine_bench.py: the closed loop runs every request to its length, never more than
`batch` at once, and ends with every page free; the replayed steps leave the engine as it was."""

from __future__ import annotations

from benchmarks.engine_bench import replay_step_ms, run_once
from engine.config import EngineConfig
from engine.generate.engine import LLMEngine
from engine.generate.request import SamplingParams
from tests.support.parity import (
    assert_all_pages_free,
    make_prompts,
    run_to_completion,
    tokens_of,
)


def test_closed_loop_replaces_finished_requests_until_all_ran(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk=8,
                                    page_size=4, max_model_len=32, warmup=False))
    result = run_once(engine, batch=2, prompt_len=5, new_tokens=3, seed=0, requests=5)
    assert (result["requests"], result["tokens"]) == (5, 15)
    assert engine.stats().max_batch_size == 2
    assert engine.stats().num_free_pages == engine.stats().num_pages


def test_without_requests_the_batch_runs_once(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=3, max_num_batched_tokens=24, prefill_chunk=8,
                                    page_size=4, max_model_len=32, warmup=False))
    result = run_once(engine, batch=3, prompt_len=5, new_tokens=4, seed=1)
    assert (result["requests"], result["tokens"]) == (3, 12)


def test_json_grammar_runs_every_request_to_its_length(llama_dir):
    """The benchmark's schema cannot complete early: constrained and free runs make as many tokens."""
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=3, max_num_batched_tokens=24, prefill_chunk=8,
                                    page_size=4, max_model_len=48, warmup=False))
    result = run_once(engine, batch=3, prompt_len=5, new_tokens=20, seed=1, grammar="json")
    assert (result["requests"], result["tokens"]) == (3, 60)
    assert engine.stats().num_free_pages == engine.stats().num_pages


def test_replaying_padding_steps_leaves_the_engine_serving_as_before(llama_dir):
    """--replay launches padding-only steps straight on the runner: they write only to the scratch
    page, so the same greedy requests give the same tokens after them."""
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk=8,
                                    page_size=4, max_model_len=32, warmup=False))
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)

    def serve(tag: str) -> list[list[int]]:
        requests = {f"{tag}{i}": (p, greedy) for i, p in enumerate(make_prompts([5, 9]))}
        out = run_to_completion(engine, requests)
        return [tokens_of(out[f"{tag}{i}"]) for i in range(2)]

    before = serve("a")
    assert replay_step_ms(engine, batch=2, steps=5) > 0
    assert serve("b") == before
    assert_all_pages_free(engine)
