"""Checkpoints saved by transformers 5 (tests/fixtures/transformers5, written by
tests/fixtures/make_transformers5_checkpoints.py with transformers 5.24): RoPE settings under
`rope_parameters`, `dtype`, a `TokenizersBackend` tokenizer. The engine answers what transformers 5
answered for each (expected.json); what the engine cannot run is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.formats.checkpoint_config import model_info, read_hf_config
from engine.formats.transformers_files import hf_config, load_tokenizer
from engine.generate.engine import LLMEngine
from engine.generate.request import SamplingParams
from tests.support.parity import run_to_completion, tokens_of
from tests.support.tiny_models import CHATML_TEMPLATE, make_tokenizer

FIXTURES = Path(__file__).parents[1] / "fixtures" / "transformers5"


@pytest.mark.parametrize("name", ["llama-default", "llama-llama3", "qwen3-yarn", "mistral-linear"])
def test_the_engine_answers_as_transformers_5_did(name):
    expected = json.loads((FIXTURES / name / "expected.json").read_text())
    assert expected["transformers"].startswith("5.")
    engine = LLMEngine(EngineConfig(model=str(FIXTURES / name), max_num_seqs=4, max_num_batched_tokens=64,
                                    max_model_len=256, warmup=False))
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=0)
    answers = expected["answers"]
    deltas = run_to_completion(engine, {str(i): (a["prompt"], params) for i, a in enumerate(answers)})
    for i, answer in enumerate(answers):
        assert tokens_of(deltas[str(i)]) == answer["tokens"], f"prompt {i}"
        np.testing.assert_allclose([lp.logprob for d in deltas[str(i)] for lp in d.logprobs], answer["logprobs"],
                                   atol=1e-3)


def test_rope_parameters_are_read_as_rope_theta_and_scaling():
    config = read_hf_config(FIXTURES / "llama-llama3")
    assert "rope_parameters" not in config
    assert config["rope_theta"] == 500000.0
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    default = read_hf_config(FIXTURES / "llama-default")
    assert (default["rope_theta"], default["rope_scaling"]) == (10000.0, None)
    assert model_info(FIXTURES / "qwen3-yarn").dtype == "float32"  # `dtype`, not `torch_dtype`


def test_a_transformers_5_tokenizer_reads_as_the_one_it_was_saved_from():
    """The fixtures' tokenizer is tiny_models' (trained the same way every time)."""
    saved = load_tokenizer(FIXTURES / "llama-default")
    original = make_tokenizer(512)
    text = "What is the capital of France? Ünïcödé 🚀 <|im_end|>"
    assert saved.encode(text) == original.encode(text)
    assert (saved.eos_token, saved.pad_token, saved.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert saved.chat_template == CHATML_TEMPLATE
    rendered = saved.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("rope, message", [
    ({"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 2.0},
     "config.json asks for RoPE type 'dynamic', which the engine does not implement; supported: default, linear, "
     "llama3, yarn, longrope"),
    ({"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
      "sliding_attention": {"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0}},
     'config.json sets RoPE per layer type ({"full_attention": {"rope_theta": 1000000.0, "rope_type": "default"}, '
     '"sliding_attention": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}}); the engine runs one RoPE '
     "for full-attention layers and an unscaled one (Gemma 3's local) for sliding layers")])
def test_rope_the_engine_cannot_run_is_refused_by_name(tmp_path, rope, message):
    model_dir = tmp_path / "model"
    shutil.copytree(FIXTURES / "llama-default", model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
    with pytest.raises(ValueError) as refused:
        LLMEngine(EngineConfig(model=str(model_dir), warmup=False))
    assert str(refused.value) == message


def test_gemma3s_rope_per_layer_type_reads_as_transformers_4_wrote_it():
    full = {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0}
    read = hf_config({"rope_parameters": {"full_attention": full,
                                          "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}})
    assert read == {"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                    "rope_local_base_freq": 1e4}


def test_transformers_4_rope_scaling_of_an_unknown_type_is_refused_too():
    with pytest.raises(ValueError, match="RoPE type 'dynamic'"):
        hf_config({"rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "factor": 2.0}})


def test_a_partial_rotary_factor_is_read_from_either_place():
    assert hf_config({"partial_rotary_factor": 0.5})["partial_rotary_factor"] == 0.5
    read = hf_config({"rope_parameters": {"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 0.25}})
    assert read == {"rope_theta": 1e4, "rope_scaling": None, "partial_rotary_factor": 0.25}
