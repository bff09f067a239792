"""The score engine (engine.score.engine, engine.models.classifier), its async driver
(engine.score.driver) and how a cross-encoder's task is detected.

Parity: tiny random rerankers (tests.support.score_models) against transformers, each pair run
alone and unpadded: BertForSequenceClassification with token types, XLMRobertaForSequenceClassification
(sigmoid of the logit, or the logit itself under sentence-transformers' Identity activation), and a
Qwen3ForCausalLM judged as Qwen3-Reranker is: P("yes") / (P("yes") + P("no")) at the last position.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import jax.monitoring
import numpy as np
import pytest

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.score.driver import AsyncScorer, Pair
from engine.score.engine import ScoreEngine
from serve_app.task_detection import checkpoint_task
from tests.support import score_models

PAIRS = [Pair([2, 5, 6, 3, 7, 8, 9, 3], 4), Pair([2, 11, 3, 12, 3], 3), Pair([2, 20, 21, 22, 23, 24, 25, 26, 3,
                                                                                   7, 7, 3], 9),
         Pair([2, 3, 3], 2), Pair([2, *range(30, 60), 3, *range(60, 80), 3], 32)]
"""Different lengths (8, 5, 12, 3, 53 tokens) and first segments in one batch."""
IDENTITY = "torch.nn.modules.linear.Identity"


@pytest.fixture(scope="module")
def reranker_factory(tmp_path_factory):
    """`reranker_factory(kind, **kwargs)` -> a tiny random reranker checkpoint (made once per arguments)."""
    made: dict[tuple, Path] = {}

    def make(kind: str, **kwargs) -> Path:
        key = (kind, tuple(sorted(kwargs.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(kind)
            made[key] = (score_models.make_qwen3_reranker(out, **kwargs) if kind == "qwen3" else
                         score_models.make_cross_encoder(out, kind, **kwargs))
        return made[key]

    return make


def make_engine(model_dir: Path, **overrides) -> ScoreEngine:
    config = dict(model=str(model_dir), max_num_seqs=8, max_num_batched_tokens=256, warmup=False,
                  compilation_cache_dir=None)
    return ScoreEngine(EngineConfig(**{**config, **overrides}))


def reference_scores(model_dir: Path, pairs: list[Pair], *, sigmoid: bool = True) -> np.ndarray:
    """transformers' sequence classifier on each pair alone: the logit, or its sigmoid."""
    import torch  # heavy: only the parity references need torch and transformers
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    types_used = model.config.type_vocab_size > 1
    out = []
    for pair in pairs:
        types = [0] * pair.first_segment + [1] * (len(pair.token_ids) - pair.first_segment)
        kwargs = {"token_type_ids": torch.tensor([types])} if types_used else {}
        with torch.no_grad():
            logit = model(torch.tensor([pair.token_ids]), **kwargs).logits[0, 0].double()
        out.append(float(torch.sigmoid(logit) if sigmoid else logit))
    return np.array(out)


def reference_judged(model_dir: Path, pairs: list[Pair]) -> np.ndarray:
    """transformers' causal LM on each pair alone: softmax over the ("no", "yes") logits at the last
    position, "yes"'s share (Qwen3-Reranker's model card)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    no, yes = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    out = []
    for pair in pairs:
        with torch.no_grad():
            logits = model(torch.tensor([pair.token_ids])).logits[0, -1].double()
        out.append(float(torch.softmax(logits[[no, yes]], dim=0)[1]))
    return np.array(out)


# ---- parity with transformers ----


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_cross_encoders_match_transformers(reranker_factory, family):
    model_dir = reranker_factory(family)
    engine = make_engine(model_dir)
    got, want = engine.score(PAIRS), reference_scores(model_dir, PAIRS)
    assert got.dtype == np.float32 and got.shape == (len(PAIRS),)
    assert np.abs(got - want).max() <= 1e-4, (got, want)
    assert want.max() - want.min() > 0.05  # the pairs score apart: a wrong token type or position would show
    assert engine.describe()["kind"] == "cross-encoder" and engine.describe()["activation"] == "sigmoid"


def test_token_types_count(reranker_factory):
    """The same ids with another split into segments score differently, each as transformers does."""
    model_dir = reranker_factory("bert")
    engine = make_engine(model_dir)
    split = [Pair(PAIRS[0].token_ids, n) for n in (2, 4, 8)]
    got, want = engine.score(split), reference_scores(model_dir, split)
    assert np.abs(got - want).max() <= 1e-4 and len(set(np.round(want, 4))) == 3


def test_identity_activation_gives_the_logit(reranker_factory):
    model_dir = reranker_factory("bert", activation=IDENTITY)
    engine = make_engine(model_dir)
    got, want = engine.score(PAIRS), reference_scores(model_dir, PAIRS, sigmoid=False)
    assert np.abs(got - want).max() <= 1e-4 and engine.describe()["activation"] == "identity"
    assert (want < 0).any() or (want > 1).any()  # not a probability


def test_qwen3_reranker_matches_transformers(reranker_factory):
    model_dir = reranker_factory("qwen3")
    engine = make_engine(model_dir, max_model_len=128)
    pairs = [Pair(p.token_ids, len(p.token_ids)) for p in PAIRS]
    got, want = engine.score(pairs), reference_judged(model_dir, pairs)
    assert np.abs(got - want).max() <= 1e-4, (got, want)
    assert want.max() - want.min() > 0.01
    assert engine.describe()["kind"] == "decoder reranker"


def test_bfloat16_is_close(reranker_factory):
    model_dir = reranker_factory("bert")
    got, want = make_engine(model_dir, dtype="bfloat16").score(PAIRS), reference_scores(model_dir, PAIRS)
    assert np.abs(got - want).max() <= 0.02


def test_scores_do_not_depend_on_the_batch(reranker_factory):
    engine = make_engine(reranker_factory("bert"))
    together = engine.score(PAIRS)
    alone = np.array([engine.score([p])[0] for p in PAIRS])
    assert np.abs(together - alone).max() <= 1e-6


def test_warmup_compiles_every_bucket_and_describe(reranker_factory):
    """The first program before the engine returns, the rest in the background; then scoring compiles nothing."""
    engine = make_engine(reranker_factory("bert"), max_num_seqs=2, max_model_len=32, warmup=True)
    assert engine.warmup_seconds > 0
    assert engine.compiler.wait(600) and engine.compile_progress() == (4, 4)
    compiles = []
    listener = lambda event, seconds, **_: compiles.append(event) if "compile" in event else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        engine.score([Pair([2, 5, 3], 2), Pair([2] * 20, 10), Pair([2] * 32, 16)])
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert engine.describe() == {"dtype": "float32", "kind": "cross-encoder", "activation": "sigmoid",
                                 "max_model_len": "32", "max_batch_size": "2", "devices": "1 x cpu", "buckets": "4"}


# ---- refusals ----


def test_validate_messages(reranker_factory):
    engine = make_engine(reranker_factory("bert"), max_model_len=16)
    cases = [
        ([], "there are no pairs to score; send at least one"),
        ([Pair([2] * 17, 1).packed()], "This model's maximum context length is 16 tokens. However, pair 0 has 17 "
                                       "tokens. Please reduce the length of the input."),
        ([Pair([2, 3], 1).packed(), Pair([2, 100], 1).packed()],
         "pair 1 names token id 100, outside the vocabulary [0, 100)"),
        ([Pair([2, 3], 3).packed()], "pair 0 has no tokens or a first segment outside them"),
    ]
    for rows, message in cases:
        with pytest.raises(InvalidRequestError) as caught:
            engine.validate(rows)
        assert (str(caught.value), caught.value.param) == (message, "input")


def test_checkpoints_it_refuses(reranker_factory, tmp_path, checkpoint_factory):
    two_labels = score_models.make_cross_encoder(tmp_path / "two", num_labels=2)
    with pytest.raises(ValueError, match="has 2 labels; a cross-encoder scores with one label"):
        make_engine(two_labels)
    with pytest.raises(ValueError, match="names architecture 'LlamaForCausalLM'; the score engine runs "
                                         "BertForSequenceClassification and XLMRobertaForSequenceClassification "
                                         "cross-encoders and Qwen3ForCausalLM rerankers"):
        make_engine(checkpoint_factory("llama"))
    softmax = reranker_factory("bert", activation="torch.nn.modules.activation.Softmax")
    with pytest.raises(ValueError, match="asks for the CrossEncoder activation 'torch.nn.modules.activation."
                                         "Softmax'; the score engine applies Sigmoid or Identity"):
        make_engine(softmax)
    no_answers = reranker_factory("qwen3", answers=False)
    with pytest.raises(ValueError, match="has no token 'no' or 'yes', which a decoder reranker answers with"):
        make_engine(no_answers)


def test_sequence_classification_checkpoints_are_score_models(reranker_factory, tmp_path):
    assert checkpoint_task(reranker_factory("bert")) == "score"
    assert checkpoint_task(reranker_factory("xlm-roberta")) == "score"
    assert checkpoint_task(reranker_factory("qwen3")) == "generate"  # Qwen3ForCausalLM: `task: score` says it


# ---- the async driver ----


class HeldEngine:
    """A real engine whose first `embed` call waits until released, so later callers queue up."""

    def __init__(self, engine: ScoreEngine):
        self.engine, self.entered, self.release = engine, threading.Event(), threading.Event()
        self.calls: list[int] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def embed(self, rows):
        self.calls.append(len(rows))
        if len(self.calls) == 1:
            self.entered.set()
            self.release.wait(30)
        return self.engine.embed(rows)


def test_concurrent_callers_merge_into_one_batch(reranker_factory):
    engine = make_engine(reranker_factory("bert"))
    held = HeldEngine(engine)
    scorer = AsyncScorer(held)
    want = engine.score(PAIRS)

    async def run():
        first = asyncio.ensure_future(scorer.score(PAIRS[:1]))
        await asyncio.to_thread(held.entered.wait, 30)
        rest = [asyncio.ensure_future(scorer.score(PAIRS[1:3])), asyncio.ensure_future(scorer.score(PAIRS[3:]))]
        await asyncio.sleep(0)  # one turn of the loop: both submit their pairs, behind the held call
        held.release.set()
        return await asyncio.gather(first, *rest)

    try:
        results = asyncio.run(run())
    finally:
        scorer.shutdown()
    assert held.calls == [1, 4]  # the two callers that waited ran as one batch
    assert np.abs(np.concatenate(results) - want).max() <= 1e-6
