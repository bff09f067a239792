"""benchmarks/engine_bench.py's closed loop: every request runs to its length, never more than
`batch` at once, and the engine ends with every page free."""

from __future__ import annotations

from benchmarks.engine_bench import run_once
from engine.core.config import EngineConfig
from engine.llm_engine import LLMEngine


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
