"""/v1/embeddings through the official `openai` client, against the app in this process: a tiny
RANDOM BERT checkpoint in the sentence-transformers layout (with a WordPiece tokenizer) on the
real embedding engine, next to a text model (routes answer 400 for the wrong kind), and a tiny random
EmbeddingGemma (tests.support.embedding_models) against sentence-transformers' own pipeline."""

from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from transformers import BertTokenizerFast

from serve_app.config import AppConfig
from serve_app.http.backends import LocalBackend
from serve_app.http.ingress import create_app
from serve_app.replicas.embed import EmbeddingServer
from serve_app.replicas.generate import TextServer
from tests.support import embedding_models, tiny_models
from tests.support.serving_helpers import held_in_tokenizing

EMBED, TEXT, GEMMA = "tiny-bert", "tiny-llama", "tiny-embeddinggemma"
WORDS = ["paris", "is", "the", "capital", "of", "france", "bananas", "are", "yellow", "a", "long", "sentence",
         "with", "many", "words", "in", "it", "short"]
TEXTS = ["paris is the capital of france", "bananas", "a long sentence with many words in it is long",
         "yellow bananas"]


def wordpiece_tokenizer(out, vocab_size: int) -> BertTokenizerFast:
    """A BERT tokenizer of `vocab_size` ids: specials, the test's words, then fillers."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    vocab += [f"w{i}" for i in range(vocab_size - len(vocab))]
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(out / "vocab.txt"), do_lower_case=True)
    tokenizer.save_pretrained(out)
    return tokenizer


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    out = tiny_models.make_bert_checkpoint(tmp_path_factory.mktemp("bert-serving"), "mean", True)
    wordpiece_tokenizer(out, 100)
    return out


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    """A tiny random EmbeddingGemma whose config.json declares the sizes it may be truncated to."""
    out = embedding_models.make_embedding_checkpoint(tmp_path_factory.mktemp("gemma-serving"), "gemma3_text")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [24, 16, 8]}))
    return out


@pytest.fixture(scope="module")
def app(bert_dir, llama_dir, gemma_dir):
    config = AppConfig.from_args({"models": [
        {"model": str(bert_dir), "model_id": EMBED, "max_num_seqs": 8, "warmup": False},
        {"model": str(llama_dir), "model_id": TEXT, "engine_cls": "tests.support.fake_engine:FakeEngine",
         "max_model_len": 128},
        {"model": str(gemma_dir), "model_id": GEMMA, "max_num_seqs": 4, "warmup": False},
    ]})
    embed, text, gemma = config.models
    assert (embed.task, embed.engine_cls) == ("embed", "engine.embed.engine:EmbeddingEngine")
    assert (gemma.task, gemma.engine_cls) == ("embed", "engine.embed.engine:EmbeddingEngine")
    servers = {EMBED: EmbeddingServer(embed), TEXT: TextServer(text), GEMMA: EmbeddingServer(gemma)}
    with TestClient(create_app({m: LocalBackend(s) for m, s in servers.items()})) as http:
        yield http, openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http), servers
    for server in servers.values():
        server.driver.shutdown()


@pytest.fixture(scope="module")
def http(app):
    return app[0]


@pytest.fixture(scope="module")
def client(app):
    return app[1]


def reference(bert_dir, ids_list: list[list[int]]) -> np.ndarray:
    """transformers' BertModel on each input alone, mean-pooled and normalised (the checkpoint's
    sentence-transformers config)."""
    import torch
    import transformers

    model = transformers.BertModel.from_pretrained(bert_dir, add_pooling_layer=False).eval()
    rows = []
    for ids in ids_list:
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0].double().numpy()
        rows.append(hidden.mean(0) / np.linalg.norm(hidden.mean(0)))
    return np.stack(rows)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_texts_of_different_lengths_match_transformers_with_exact_usage(client, bert_dir):
    response = client.embeddings.create(model=EMBED, input=TEXTS)
    tokenizer = BertTokenizerFast.from_pretrained(bert_dir)
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert len({len(i) for i in ids}) == len(TEXTS)  # every length differs
    got = np.array([d.embedding for d in response.data])
    assert [d.index for d in response.data] == [0, 1, 2, 3] and got.shape == (4, 32)
    assert cosines(got, reference(bert_dir, ids)).min() >= 0.9999
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert (response.usage.prompt_tokens, response.usage.total_tokens) == (sum(map(len, ids)), sum(map(len, ids)))
    assert response.model == EMBED and response.object == "list"


def test_token_ids_and_base64(client, http, bert_dir):
    ids = [[2, 5, 6, 7, 3], [2, 11, 3]]
    floats = client.embeddings.create(model=EMBED, input=ids, encoding_format="float")
    assert cosines(np.array([d.embedding for d in floats.data]), reference(bert_dir, ids)).min() >= 0.9999
    assert floats.usage.prompt_tokens == 8
    one = client.embeddings.create(model=EMBED, input=ids[0])
    assert np.allclose(one.data[0].embedding, floats.data[0].embedding, atol=1e-6)
    raw = http.post("/v1/embeddings", json={"model": EMBED, "input": ids, "encoding_format": "base64"}).json()
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in raw["data"]]
    assert np.array_equal(np.stack(decoded), np.array([d.embedding for d in floats.data], np.float32))
    assert client.embeddings.create(model=EMBED, input="paris", dimensions=32).data[0].embedding


@pytest.mark.parametrize("body,message,param", [
    ({"input": ""}, "input[0] is an empty string; send some text", "input"),
    ({"input": []}, "input must be a string, a non-empty list of strings, a non-empty list of token ids, or a "
                    "non-empty list of non-empty token-id lists", "input"),
    ({"input": [[2, 3], []]}, "input must be a string, a non-empty list of strings, a non-empty list of token ids, "
                              "or a non-empty list of non-empty token-id lists", "input"),
    ({"input": [2, 100]}, "input holds token ids outside the vocabulary [0, 100): [100]", "input"),
    ({"input": [2] * 65}, "This model's maximum context length is 64 tokens. However, input[0] has 65 tokens. "
                          "Please reduce the length of the input.", "input"),
    ({"input": "paris", "dimensions": 16}, "model 'tiny-bert' makes 32-dimensional embeddings and cannot be "
                                           "truncated to 16; leave dimensions out or set it to 32", "dimensions"),
    ({"input": "paris", "encoding_format": "int8"}, "encoding_format: Input should be 'float' or 'base64'",
     "encoding_format"),
])
def test_bad_inputs_are_400s(http, body, message, param):
    response = http.post("/v1/embeddings", json={"model": EMBED, **body})
    assert (response.status_code, response.json()) == (400, {"error": {
        "message": message, "type": "invalid_request_error", "param": param, "code": None}})


def test_each_model_answers_only_its_own_routes(client, http):
    assert {m.id: m.task for m in client.models.list().data} == {EMBED: "embed", TEXT: "generate", GEMMA: "embed"}
    wrong = [
        (http.post("/v1/embeddings", json={"model": TEXT, "input": "x"}),
         f"model '{TEXT}' is a text generation model; send this request to /v1/completions or "
         "/v1/chat/completions"),
        (http.post("/v1/completions", json={"model": EMBED, "prompt": "x"}),
         f"model '{EMBED}' is an embedding model; send this request to /v1/embeddings"),
        (http.post("/v1/chat/completions", json={"model": EMBED, "messages": [{"role": "user", "content": "x"}]}),
         f"model '{EMBED}' is an embedding model; send this request to /v1/embeddings"),
    ]
    for response, message in wrong:
        assert (response.status_code, response.json()["error"]["message"], response.json()["error"]["param"]) == (
            400, message, "model")
    assert http.post("/v1/completions", json={"model": TEXT, "prompt": "x", "max_tokens": 2}).status_code == 200


def test_tokenize_and_detokenize_an_embedding_model(http, bert_dir):
    tokens = http.post("/tokenize", json={"model": EMBED, "prompt": "Paris is", "return_token_strs": True}).json()
    assert tokens == {"count": 4, "max_model_len": 64, "tokens": [2, 5, 6, 3],
                      "token_strs": ["[CLS]", "paris", "is", "[SEP]"]}
    assert http.post("/detokenize", json={"model": EMBED, "tokens": [5, 6]}).json() == {"prompt": "paris is"}
    bad = http.post("/detokenize", json={"model": EMBED, "tokens": [5, 1000]})
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "tokens")


def test_concurrent_requests_each_get_their_own_rows(app, bert_dir):
    """Concurrent requests share the encoder's batches (how they merge is AsyncEmbedder's, tested
    deterministically in test_embedding_engine.py); each still gets its own vectors."""
    import concurrent.futures

    client = app[1]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda t: client.embeddings.create(model=EMBED, input=[t]), TEXTS * 4))
    tokenizer = BertTokenizerFast.from_pretrained(bert_dir)
    want = reference(bert_dir, [tokenizer.encode(t) for t in TEXTS * 4])
    got = np.array([a.data[0].embedding for a in answers])
    assert cosines(got, want).min() >= 0.9999


def test_an_input_held_in_its_tokenizing_does_not_hold_up_other_requests(app, bert_dir):
    """Inputs are tokenized off the event loop: while one request is held inside its tokenizing,
    another is answered; then the held one is answered too (on its first try: no retries)."""
    import concurrent.futures

    _, client, servers = app
    client = client.with_options(max_retries=0)
    with (held_in_tokenizing(servers[EMBED].prompts, "bananas") as (entered, release),
          concurrent.futures.ThreadPoolExecutor(1) as pool):
        held = pool.submit(client.embeddings.create, model=EMBED, input=["bananas"])
        assert entered.wait(timeout=30)
        other = client.embeddings.create(model=EMBED, input=["yellow bananas"])
        release.set()
        answers = [held.result(timeout=60), other]
    tokenizer = BertTokenizerFast.from_pretrained(bert_dir)
    want = reference(bert_dir, [tokenizer.encode(t) for t in ("bananas", "yellow bananas")])
    assert cosines(np.array([a.data[0].embedding for a in answers]), want).min() >= 0.9999


def test_embeddinggemma_matches_sentence_transformers_and_truncates(client, gemma_dir):
    """Texts through the tokenizer, Gemma's bidirectional layers, mean pooling, two Dense modules and
    Normalize; `dimensions` keeps a declared Matryoshka size's first values, normalised again, as
    sentence-transformers' encode(truncate_dim=..., normalize_embeddings=True) does."""
    from sentence_transformers import SentenceTransformer  # heavy: the reference only
    from transformers import AutoTokenizer

    texts = ["The quick brown fox jumps over the lazy dog.", "Hello", "Once upon a time there was a little engine."]
    reference = SentenceTransformer(str(gemma_dir), device="cpu")
    full = client.embeddings.create(model=GEMMA, input=texts)
    got = np.array([d.embedding for d in full.data])
    assert got.shape == (3, 24) and cosines(got, reference.encode(texts)).min() >= 0.9999
    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    assert full.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in texts)
    short = client.embeddings.create(model=GEMMA, input=texts, dimensions=16)
    got = np.array([d.embedding for d in short.data])
    want = reference.encode(texts, truncate_dim=16, normalize_embeddings=True)
    assert got.shape == (3, 16) and cosines(got, want).min() >= 0.9999
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
