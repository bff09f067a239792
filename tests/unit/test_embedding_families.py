"""The embedding families beyond BERT on the embedding engine (engine.models.sentence_transformer,
engine.models.encoder's XLM-RoBERTa, engine.models.decoder_embedder): XLM-RoBERTa (bge-m3,
multilingual-e5), EmbeddingGemma and Qwen3-Embedding, each a tiny random checkpoint written by
tests.support.embedding_models.

Parity: sentence-transformers' own pipeline, `SentenceTransformer(dir).encode(texts)` on the whole
batch (padded as the family's tokenizer pads: Qwen3's on the left), against the engine on the
same texts' token ids, batched across buckets.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.embed.engine import EmbeddingEngine
from engine.models.sentence_transformer import read_checkpoint
from serve_app.task_detection import detect_task
from tests.support import embedding_models
from tests.support.tiny_models import _CORPUS

TEXTS = [*_CORPUS[:5], "a", "Hello", "Ünïcödé 🚀 中文"]
"""Lengths from 3 to over 20 tokens (at most 64): past Gemma's sliding window (|i - j| < 5) on both sides."""


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    """`family_dir(family, **kwargs)` -> a checkpoint of embedding_models (made once per arguments;
    XLM-RoBERTa's pooling is "cls" unless given)."""
    made: dict[tuple, Path] = {}

    def make(family: str, **kwargs) -> Path:
        if family == "xlm-roberta":
            kwargs.setdefault("pooling", "cls")
        key = (family, tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = embedding_models.make_embedding_checkpoint(tmp_path_factory.mktemp(family), family, **kwargs)
        return made[key]

    return make


def make_engine(model_dir: Path, **overrides) -> EmbeddingEngine:
    config = dict(model=str(model_dir), max_num_seqs=4, max_num_batched_tokens=128, warmup=False,
                  compilation_cache_dir=None)
    return EmbeddingEngine(EngineConfig(**{**config, **overrides}))


def token_ids(model_dir: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer  # heavy: only the references need transformers

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(text)["input_ids"] for text in texts]


def sentence_transformers_embeddings(model_dir: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer  # heavy: the reference only

    model = SentenceTransformer(str(model_dir), device="cpu")
    return model.encode(texts, batch_size=len(texts), convert_to_numpy=True).astype(np.float64)


def assert_close(got: np.ndarray, want: np.ndarray, cosine: float = 0.9999, atol: float = 1e-4) -> None:
    assert got.shape == want.shape
    cosines = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cosines.min() >= cosine, cosines
    assert np.abs(got - want).max() <= atol * max(1.0, np.abs(want).max())


# ---- parity with sentence-transformers ----


@pytest.mark.parametrize("family, kwargs, dimensions", [
    ("xlm-roberta", {"pooling": "cls"}, 32),
    ("xlm-roberta", {"pooling": "mean"}, 32),
    ("gemma3_text", {}, 24),
    ("qwen3", {}, 32),
])
def test_matches_sentence_transformers(family_dir, family, kwargs, dimensions):
    model_dir = family_dir(family, **kwargs)
    ids = token_ids(model_dir, TEXTS)
    assert len({len(i) for i in ids}) >= 6 and 20 < max(map(len, ids)) <= 64
    engine = make_engine(model_dir)
    got = engine.embed(ids)
    assert got.dtype == np.float32 and engine.dimensions == dimensions
    assert_close(got, sentence_transformers_embeddings(model_dir, TEXTS))
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)


def test_tokenizers_add_the_families_special_tokens(family_dir):
    """What the engine is given: XLM-R's <s> ... </s>, Gemma's <bos> ... <eos>, Qwen3's text then
    <|endoftext|> (the token whose state Qwen3-Embedding pools); Qwen3's pads on the left."""
    from transformers import AutoTokenizer

    first = {"xlm-roberta": (0, 2), "gemma3_text": (2, 1), "qwen3": (None, 0)}
    for family, (bos, eos) in first.items():
        tokenizer = AutoTokenizer.from_pretrained(family_dir(family))
        ids = tokenizer("Hello")["input_ids"]
        assert ids[-1] == eos and (bos is None or ids[0] == bos) and (bos is not None or 0 not in ids[:-1])
    assert tokenizer.padding_side == "left"


def test_rows_do_not_depend_on_the_batch(family_dir):
    for family in ("gemma3_text", "qwen3"):
        engine = make_engine(family_dir(family))
        ids = token_ids(family_dir(family), TEXTS)
        alone = engine.embed([ids[0]])[0]
        with_others = engine.embed([ids[1], ids[0], ids[7]])[1]
        np.testing.assert_allclose(with_others, alone, atol=1e-5)


def test_bfloat16_is_close(family_dir):
    model_dir = family_dir("gemma3_text")
    engine = make_engine(model_dir, dtype="bfloat16")
    assert engine.describe()["dtype"] == "bfloat16"
    got = engine.embed(token_ids(model_dir, TEXTS))
    assert_close(got, sentence_transformers_embeddings(model_dir, TEXTS), cosine=0.99, atol=0.1)


# ---- checkpoints ----


def test_xlm_roberta_positions_leave_room_for_the_padding_offset(family_dir):
    model_dir = family_dir("xlm-roberta")
    checkpoint = read_checkpoint(model_dir)
    assert (checkpoint.config.padding_idx, checkpoint.config.max_positions) == (1, 64)
    assert make_engine(model_dir, max_model_len=None).max_model_len == 64
    with pytest.raises(ValueError, match=r"max_model_len=65 exceeds the model's max_position_embeddings=66 less its "
                                         r"position offset 2; lower max_model_len"):
        make_engine(model_dir, max_model_len=65)


def test_gemma_checkpoint_reads_its_modules_and_window(family_dir):
    checkpoint = read_checkpoint(family_dir("gemma3_text"))
    assert checkpoint.pooling.modes == ("mean",) and checkpoint.pooling.normalize
    assert [(d.in_features, d.out_features, d.bias, d.activation) for d in checkpoint.dense] == [
        (32, 64, False, "identity"), (64, 24, False, "identity")]
    config = checkpoint.config
    assert (config.bidirectional, config.sliding_window, config.sliding_layers) == (True, 5, (True, True, False, True))
    assert (config.query_scale, checkpoint.dimensions) == (0.25, 24)


def test_pooling_configs_old_and_new(family_dir, tmp_path):
    """sentence-transformers' older `pooling_mode_*` flags and its newer `pooling_mode` (a name or a
    list, concatenated in its order); modes it has that the engine lacks are refused."""
    model_dir = Path(shutil.copytree(family_dir("qwen3"), tmp_path / "qwen3"))
    assert read_checkpoint(model_dir).pooling.modes == ("lasttoken",)
    pooling = model_dir / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({"embedding_dimension": 32, "pooling_mode": ["mean", "cls"]}))
    assert read_checkpoint(model_dir).pooling.modes == ("mean", "cls") and read_checkpoint(model_dir).dimensions == 64
    pooling.write_text(json.dumps({"word_embedding_dimension": 32, "pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(ValueError, match="asks for pooling by weightedmean; the embedding engine pools by cls, max, "
                                         "mean, mean_sqrt_len, lasttoken only"):
        read_checkpoint(model_dir)
    (model_dir / "modules.json").unlink()  # a plain causal checkpoint: its last token, unnormalised
    checkpoint = read_checkpoint(model_dir)
    assert (checkpoint.pooling.modes, checkpoint.pooling.normalize) == (("lasttoken",), False)


def test_dense_module_errors(family_dir, tmp_path):
    model_dir = Path(shutil.copytree(family_dir("gemma3_text"), tmp_path / "gemma"))
    dense = model_dir / "2_Dense" / "config.json"
    config = json.loads(dense.read_text())
    dense.write_text(json.dumps({**config, "activation_function": "torch.nn.modules.activation.ReLU"}))
    with pytest.raises(ValueError, match="has activation_function 'torch.nn.modules.activation.ReLU'; the embedding "
                                         "engine runs Dense modules with torch.nn.modules.linear.Identity or "):
        read_checkpoint(model_dir)
    dense.write_text(json.dumps({**config, "in_features": 48}))
    with pytest.raises(ValueError, match="has in_features 48, but the module before it makes 32 values"):
        read_checkpoint(model_dir)
    modules = json.loads((model_dir / "modules.json").read_text())
    (model_dir / "modules.json").write_text(json.dumps([modules[0], modules[4], modules[1]]))
    with pytest.raises(ValueError, match="lists Transformer, Normalize, Pooling; the embedding engine runs one "
                                         "Transformer, one Pooling, any Dense modules and one Normalize, in that"):
        read_checkpoint(model_dir)


def test_sentence_transformers_dirs_serve_embeddings(family_dir, tmp_path):
    """modules.json routes a gemma3_text / qwen3 checkpoint to embed; without it a qwen3 generates
    and an XLM-RoBERTa encoder embeds (its model_type)."""
    for family in embedding_models.FAMILIES:
        assert detect_task(str(family_dir(family))) == "embed"
    plain = Path(shutil.copytree(family_dir("qwen3"), tmp_path / "plain"))
    (plain / "modules.json").unlink()
    assert detect_task(str(plain)) == "generate"
    plain = Path(shutil.copytree(family_dir("xlm-roberta"), tmp_path / "plain-xlmr"))
    (plain / "modules.json").unlink()  # an XLMRobertaModel without sentence-transformers' files: still embed
    assert detect_task(str(plain)) == "embed"
