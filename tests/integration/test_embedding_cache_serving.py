"""The embedding cache through the app in this process, on the real embedding engine (a tiny random
BERT in the sentence-transformers layout, trained for any `dimensions`): repeated inputs get the
very vector the model made for them first, `dimensions` and base64 apply to cached vectors, the
least recently used input goes first, hits and misses are counted in /metrics, and /v1/models shows
the model's dimensions."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from transformers import BertTokenizerFast

from serve_app.config import AppConfig
from serve_app.http.backends import LocalBackend
from serve_app.http.ingress import create_app
from serve_app.replicas.embed import EmbeddingServer
from tests.support import tiny_models
from tests.support.serving_helpers import metric

EMBED = "tiny-bert-cached"
WORDS = ["paris", "is", "the", "capital", "of", "france", "bananas", "are", "yellow"]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    out = tiny_models.make_bert_checkpoint(tmp_path_factory.mktemp("bert-cache"), "mean", True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (out / "vocab.txt").write_text("\n".join(vocab + [f"w{i}" for i in range(100 - len(vocab))]) + "\n")
    BertTokenizerFast(vocab_file=str(out / "vocab.txt"), do_lower_case=True).save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    return out


@pytest.fixture(scope="module")
def app(bert_dir):
    config = AppConfig.from_args({"model": str(bert_dir), "model_id": EMBED, "max_num_seqs": 8, "warmup": False,
                                  "embedding_cache_size": 2})
    server = EmbeddingServer(config.models[0])
    with TestClient(create_app({EMBED: LocalBackend(server)})) as http:
        yield server, http
    server.driver.shutdown()


def embeddings(http, inputs, **body) -> list:
    response = http.post("/v1/embeddings", json={"model": EMBED, "input": inputs, **body})
    assert response.status_code == 200, response.text
    return [row["embedding"] for row in response.json()["data"]]


def counts(http) -> tuple[float, float]:
    return (metric(http, "jax_serve:embedding_cache_hits_total", EMBED),
            metric(http, "jax_serve:embedding_cache_misses_total", EMBED))


def test_repeated_inputs_get_the_same_vector_and_the_oldest_goes_first(app):
    server, http = app
    paris, bananas, paris_again = embeddings(http, ["paris", "bananas", "paris"])
    assert paris_again == paris and len(paris) == 32
    assert counts(http) == (0, 3)
    assert embeddings(http, [[2, 5, 3]]) == [paris]  # "paris" as token ids: the same key
    assert counts(http) == (1, 3)
    assert embeddings(http, ["yellow bananas", "paris"])[1] == paris  # bananas was the oldest: it goes
    assert counts(http) == (2, 4)

    (encoded,) = embeddings(http, "bananas", dimensions=8, encoding_format="base64")  # made again
    cut = np.asarray(bananas[:8], np.float32)
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(encoded), "<f4"), cut / np.linalg.norm(cut), rtol=1e-5)
    assert counts(http) == (2, 5)
    assert embeddings(http, "bananas", dimensions=8, encoding_format="base64") == [encoded]  # a hit, cut again
    assert counts(http) == (3, 5)
    assert len(server.cache) == 2


def test_models_shows_the_dimensions(app):
    server, http = app
    card = http.get(f"/v1/models/{EMBED}").json()
    assert (card["dimensions"], card["max_model_len"], card["sampling_defaults"]) == (32, server.max_model_len, None)
