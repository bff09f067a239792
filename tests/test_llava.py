"""A LLaVA checkpoint served as text: its decoder converted once into a text checkpoint of its own
(engine.formats.llava), greedy tokens equal to transformers' LlavaForConditionalGeneration on
text-only prompts. (Image inputs are not yet placed into prompts.)"""

from __future__ import annotations

import json

import pytest
import torch
from parity import TIGHT, make_prompts, run_to_completion, tokens_of
from tiny_models import make_llava_checkpoint

from engine.core.config import EngineConfig
from engine.core.request import SamplingParams
from engine.formats import llava
from engine.formats.model_sources import resolve_model
from engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_llava_checkpoint(tmp_path_factory.mktemp("llava"))


def test_the_decoder_becomes_a_text_checkpoint_once(checkpoint, tmp_path):
    text = resolve_model(str(checkpoint), cache_dir=tmp_path)
    assert text != checkpoint and text.parent == tmp_path.resolve()
    config = json.loads((text / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (text / llava.VISION_LINK).resolve() == checkpoint.resolve()
    assert (text / "tokenizer.json").is_file() and (text / "preprocessor_config.json").is_file()
    assert resolve_model(str(checkpoint), cache_dir=tmp_path) == text  # a cache hit: built once


def test_text_prompts_equal_transformers_llava(checkpoint, tmp_path):
    import transformers

    engine = LLMEngine(EngineConfig(model=str(resolve_model(str(checkpoint), cache_dir=tmp_path)), **TIGHT))
    reference = transformers.LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompts = make_prompts(lengths=(5, 19, 40), vocab=300)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens_of(outputs[str(i)]) == expected
