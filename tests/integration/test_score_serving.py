"""/v1/rerank and /v1/score through the official `openai` client's raw HTTP (the SDK has no rerank
call), against the app in this process: a tiny RANDOM BERT cross-encoder (auto-detected as a score
model from its architecture) and a tiny random Qwen3-Reranker-shaped causal LM (`task: score`), each
on the real score engine, next to a text model (routes answer 400 for the wrong kind). References:
transformers on the pairs as each model's tokenizer / template encodes them, each pair alone."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import torch
import transformers
from fastapi.testclient import TestClient

from serve_app.config import AppConfig
from serve_app.http.backends import LocalBackend
from serve_app.http.ingress import create_app
from serve_app.replicas.generate import TextServer
from serve_app.replicas.score import QWEN3_RERANKER, ScoreServer
from tests.support import score_models

RERANK, JUDGE, TEXT = "tiny-reranker", "tiny-qwen3-reranker", "tiny-llama"
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "bananas are yellow", "a long sentence with many words in it",
             "the capital city of france is paris"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return (score_models.make_cross_encoder(tmp_path_factory.mktemp("cross-encoder")),
            score_models.make_qwen3_reranker(tmp_path_factory.mktemp("qwen3-reranker")))


@pytest.fixture(scope="module")
def app(model_dirs, llama_dir):
    bert_dir, qwen_dir = model_dirs
    config = AppConfig.from_args({"models": [
        {"model": str(bert_dir), "model_id": RERANK, "max_num_seqs": 8, "warmup": False},
        {"model": str(qwen_dir), "model_id": JUDGE, "task": "score", "max_model_len": 256, "warmup": False},
        {"model": str(llama_dir), "model_id": TEXT, "engine_cls": "tests.support.fake_engine:FakeEngine",
         "max_model_len": 128},
    ]})
    rerank, judge, text = config.models
    assert (rerank.task, rerank.engine_cls) == ("score", "engine.score.engine:ScoreEngine")
    servers = {RERANK: ScoreServer(rerank), JUDGE: ScoreServer(judge), TEXT: TextServer(text)}
    with TestClient(create_app({m: LocalBackend(s) for m, s in servers.items()})) as http:
        yield http, openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)
    for server in servers.values():
        server.driver.shutdown()


@pytest.fixture(scope="module")
def http(app):
    return app[0]


@pytest.fixture(scope="module")
def client(app):
    return app[1]


def cross_encoder_reference(model_dir, query: str, documents: list[str]) -> tuple[np.ndarray, int]:
    """sigmoid of BertForSequenceClassification's logit for each (query, document) as the tokenizer
    pairs them, and the tokens of all pairs."""
    tokenizer = transformers.BertTokenizerFast.from_pretrained(model_dir)
    model = transformers.BertForSequenceClassification.from_pretrained(model_dir).eval()
    scores, tokens = [], 0
    for document in documents:
        encoded = tokenizer(query, document, return_tensors="pt")
        tokens += encoded["input_ids"].shape[1]
        with torch.no_grad():
            scores.append(float(torch.sigmoid(model(**encoded).logits[0, 0].double())))
    return np.array(scores), tokens


def judge_reference(model_dir, query: str, documents: list[str]) -> np.ndarray:
    """Qwen3-Reranker's model-card recipe: prefix + formatted pair + suffix, each tokenized without
    special tokens; "yes"'s share of softmax over the ("no", "yes") logits at the last position."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    no, yes = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    t = QWEN3_RERANKER
    scores = []
    for document in documents:
        text = t.pair.format(instruction=t.instruction, query=query, document=document)
        ids = sum((tokenizer.encode(part, add_special_tokens=False) for part in (t.prefix, text, t.suffix)), [])
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        scores.append(float(torch.softmax(logits[[no, yes]], dim=0)[1]))
    return np.array(scores)


def test_rerank_sorts_by_relevance_with_exact_usage(client, model_dirs):
    want, tokens = cross_encoder_reference(model_dirs[0], QUERY, DOCUMENTS)
    body = client.post("/rerank", cast_to=object, body={"model": RERANK, "query": QUERY, "documents": DOCUMENTS})
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    assert [r["index"] for r in body["results"]] == order
    assert [r["document"] for r in body["results"]] == [{"text": DOCUMENTS[i]} for i in order]
    got = np.array([r["relevance_score"] for r in body["results"]])
    assert np.abs(got - want[order]).max() <= 1e-4 and want.max() - want.min() > 0.01
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert body["model"] == RERANK and body["id"].startswith("rerank-")
    top = client.post("/rerank", cast_to=object, body={"model": RERANK, "query": QUERY, "documents": DOCUMENTS,
                                                       "top_n": 2, "return_documents": False})
    assert top["results"] == [{"index": r["index"], "relevance_score": r["relevance_score"]}
                              for r in body["results"][:2]]
    assert top["usage"] == body["usage"]  # every document is scored, whatever top_n keeps


def test_score_pairs_one_to_many_and_one_to_one(client, model_dirs):
    want, tokens = cross_encoder_reference(model_dirs[0], QUERY, DOCUMENTS)
    many = client.post("/score", cast_to=object, body={"model": RERANK, "text_1": QUERY, "text_2": DOCUMENTS})
    assert [(d["index"], d["object"]) for d in many["data"]] == [(i, "score") for i in range(4)]
    assert np.abs(np.array([d["score"] for d in many["data"]]) - want).max() <= 1e-4
    assert many["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert (many["object"], many["model"]) == ("list", RERANK) and many["id"].startswith("score-")
    firsts = [QUERY, "bananas"]
    one = client.post("/score", cast_to=object, body={"model": RERANK, "text_1": firsts, "text_2": DOCUMENTS[:2]})
    second, _ = cross_encoder_reference(model_dirs[0], "bananas", DOCUMENTS[1:2])
    assert np.abs(np.array([d["score"] for d in one["data"]]) - [want[0], second[0]]).max() <= 1e-4
    single = client.post("/score", cast_to=object, body={"model": RERANK, "text_1": QUERY, "text_2": DOCUMENTS[3]})
    assert abs(single["data"][0]["score"] - want[3]) <= 1e-4 and len(single["data"]) == 1


def test_qwen3_reranker_scores_its_template(client, model_dirs):
    want = judge_reference(model_dirs[1], QUERY, DOCUMENTS)
    body = client.post("/rerank", cast_to=object, body={"model": JUDGE, "query": QUERY, "documents": DOCUMENTS})
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    assert np.abs(np.array([got[i] for i in range(4)]) - want).max() <= 1e-4
    assert [r["index"] for r in body["results"]] == sorted(range(4), key=lambda i: -want[i])


@pytest.mark.parametrize("path,body,message,param", [
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents is empty; send at least one document",
     "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": ["paris"], "top_n": 0},
     "top_n: Input should be greater than or equal to 1", "top_n"),
    ("/v1/rerank", {"query": "paris " * 70, "documents": ["paris"]},
     "This model's maximum context length is 64 tokens. However, query alone takes 73 tokens (with the model's "
     "special tokens or template), leaving no room for documents. Please reduce the length of query.", "query"),
    ("/v1/rerank", {"query": QUERY, "documents": ["paris", "paris " * 60]},
     "This model's maximum context length is 64 tokens. However, the pair of documents[1] has 69 tokens. Please "
     "reduce the length of the input.", "documents"),
    ("/v1/score", {"text_1": ["paris", "france"], "text_2": ["a", "b", "c"]},
     "text_1 holds 2 texts and text_2 3; send lists of one length (one pair each), or one text_1 for every text_2",
     "text_2"),
    ("/v1/score", {"text_1": [], "text_2": "a"}, "text_1 is empty; send a string or a non-empty list of strings",
     "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 3},
     "'truncate_prompt_tokens' is not a supported field; remove it", "truncate_prompt_tokens"),
])
def test_bad_inputs_are_400s(http, path, body, message, param):
    response = http.post(path, json={"model": RERANK, **body})
    assert (response.status_code, response.json()) == (400, {"error": {
        "message": message, "type": "invalid_request_error", "param": param, "code": None}})


def test_each_model_answers_only_its_own_routes(client, http):
    assert {m.id: m.task for m in client.models.list().data} == {RERANK: "score", JUDGE: "score", TEXT: "generate"}
    wrong = [
        (http.post("/v1/rerank", json={"model": TEXT, "query": "x", "documents": ["y"]}),
         f"model '{TEXT}' is a text generation model; send this request to /v1/completions or /v1/chat/completions"),
        (http.post("/v1/completions", json={"model": RERANK, "prompt": "x"}),
         f"model '{RERANK}' is a score (rerank) model; send this request to /v1/rerank or /v1/score"),
    ]
    for response, message in wrong:
        assert (response.status_code, response.json()["error"]["message"], response.json()["error"]["param"]) == (
            400, message, "model")
