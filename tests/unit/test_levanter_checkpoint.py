"""Serving a checkpoint levanter's checkpointer wrote (engine.formats.levanter_checkpoint).

The checkpoints are written with levanter's own `save_checkpoint`, as a training run writes them
(the model under `model/` beside other state, one `step-N` folder per save). The converted
checkpoint must compute what the levanter model computes (logits through transformers, the
reference), and the engine must decode it as transformers does.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from engine.config import EngineConfig, ModelSource
from engine.formats.model_sources import resolve_model
from engine.generate.request import SamplingParams
from tests.support.parity import (
    hf_greedy,
    hf_model,
    make_prompts,
    run_to_completion,
    tokens_of,
)

MODEL_SECTION = {"type": "llama", "seq_len": 256, "hidden_dim": 64, "intermediate_dim": 128, "num_layers": 2,
                 "num_heads": 4, "num_kv_heads": 2, "initializer_range": 0.2}
"""The `model:` section of a training config (a large initializer_range: peaked, tie-free logits)."""


def write_levanter_run(run_dir, section, vocab_size: int, steps=(3, 7)):
    """A run's checkpoints, one random model per step (the last step's is returned, as levanter built it)."""
    import draccus
    import haliax as hax
    import jax
    from levanter.checkpoint import save_checkpoint
    from levanter.models.lm_model import LmConfig
    from levanter.utils.jax_utils import local_cpu_mesh

    config = draccus.decode(LmConfig, section)
    with local_cpu_mesh():
        for step in steps:
            model = config.build(hax.Axis("vocab", vocab_size), key=jax.random.PRNGKey(step))
            save_checkpoint({"model": model, "step": step}, step, str(run_dir / f"step-{step}"))
    return model


@pytest.fixture(scope="module")
def levanter_run(tmp_path_factory, llama_dir):
    """(run directory, the newest step's levanter model, tokenizer directory)."""
    from engine.formats.transformers_files import load_tokenizer

    run = tmp_path_factory.mktemp("run")
    model = write_levanter_run(run, MODEL_SECTION, len(load_tokenizer(str(llama_dir))))
    return run, model, llama_dir


@pytest.fixture(scope="module")
def converted(levanter_run, tmp_path_factory):
    run, _, tokenizer = levanter_run
    cache = tmp_path_factory.mktemp("cache")
    return resolve_model(ModelSource(str(run), tokenizer=str(tokenizer), levanter_model=MODEL_SECTION,
                                     cache_dir=str(cache)))


def test_the_newest_step_converts_to_a_checkpoint_that_computes_what_levanter_computes(levanter_run, converted):
    import haliax as hax
    import torch
    from levanter.layers.attention import AttentionMask

    _, model, _ = levanter_run
    assert converted.name.startswith("levanter-step-7-")
    config = json.loads((converted / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"],
            config["vocab_size"]) == ("llama", 64, 2, 2, model.Vocab.size)
    assert (converted / "tokenizer.json").is_file() and (converted / "model.safetensors").is_file()

    prompt = make_prompts([20], seed=3)[0]
    ids = hax.named(np.array(prompt, np.int32), "position")
    theirs = np.asarray(model(ids, attn_mask=AttentionMask.causal()).array)
    with torch.no_grad():
        ours = hf_model(str(converted))(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=1e-4)


def test_the_engine_serves_the_converted_checkpoint_as_transformers_does(converted):
    from engine.generate.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(converted), max_num_seqs=4, max_model_len=128, warmup=False))
    try:
        prompts = make_prompts([5, 17], seed=1)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        deltas = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
        for i, prompt in enumerate(prompts):
            assert tokens_of(deltas[str(i)]) == hf_greedy(converted, prompt, 12)[0]
    finally:
        engine.shutdown()


def test_a_vocabulary_padded_for_the_training_mesh_is_read_from_the_checkpoint(levanter_run, tmp_path):
    """levanter's training rounds the tokenizer's vocabulary up to split over its mesh: the stored
    embedding's size wins, and the engine serves the padded model as transformers does."""
    from engine.formats.transformers_files import load_tokenizer
    from engine.generate.engine import LLMEngine

    _, _, tokenizer = levanter_run
    padded = 128 * (len(load_tokenizer(str(tokenizer))) // 128 + 1)
    run = tmp_path / "run"
    write_levanter_run(run, MODEL_SECTION, padded, steps=(2,))
    converted = resolve_model(ModelSource(str(run), tokenizer=str(tokenizer), levanter_model=MODEL_SECTION,
                                          cache_dir=str(tmp_path / "cache")))
    assert json.loads((converted / "config.json").read_text())["vocab_size"] == padded
    engine = LLMEngine(EngineConfig(model=str(converted), max_num_seqs=2, max_model_len=128, warmup=False))
    try:
        prompt = make_prompts([9], seed=5)[0]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        assert tokens_of(run_to_completion(engine, {"a": (prompt, params)})["a"]) == hf_greedy(converted, prompt, 8)[0]
    finally:
        engine.shutdown()


def test_a_training_yaml_names_the_same_model_and_hits_the_cache(levanter_run, converted, tmp_path):
    run, _, tokenizer = levanter_run
    train = tmp_path / "train.yaml"
    train.write_text(yaml.safe_dump({"data": {"id": "x"}, "model": MODEL_SECTION, "trainer": {"num_train_steps": 7}}))
    marker = (converted / ".jax-serve-complete.json").read_text()
    again = resolve_model(ModelSource(str(run / "step-7"), tokenizer=str(tokenizer), levanter_model=str(train),
                                      cache_dir=str(converted.parent)))
    assert again == converted and (converted / ".jax-serve-complete.json").read_text() == marker


def test_wrong_sizes_and_a_missing_checkpoint_say_what_to_change(levanter_run, tmp_path):
    run, _, tokenizer = levanter_run
    wider = {**MODEL_SECTION, "hidden_dim": 128}
    with pytest.raises(ValueError, match=r"step-7 does not hold a LlamaConfig of these sizes with a vocabulary of"):
        resolve_model(ModelSource(str(run), tokenizer=str(tokenizer), levanter_model=wider, cache_dir=str(tmp_path)))
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith(".")], "a failed conversion left an entry"
    with pytest.raises(ValueError, match="holds no levanter checkpoint"):
        resolve_model(ModelSource(str(tmp_path), tokenizer=str(tokenizer), levanter_model=MODEL_SECTION,
                                  cache_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="with its `type`"):
        resolve_model(ModelSource(str(run), tokenizer=str(tokenizer), levanter_model={"hidden_dim": 64}))
