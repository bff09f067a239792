"""Sampling defaults from generation_config.json on the real engine, through the app in this process:
the tiny Llama whose checkpoint says top_k 1 (and temperature 0.8) answers a request that sends
neither with transformers' greedy tokens, and a request's own value wins."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from tests.support.parity import hf_greedy
from tests.support.serving_helpers import app_in_process

MODEL = "tiny-llama-defaults"
PROMPT = [17, 42, 99, 7, 250, 31, 64]
TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sampling-defaults") / "ckpt"
    shutil.copytree(llama_dir, out)
    path = llama_dir / "generation_config.json"
    generation = json.loads(path.read_text()) if path.is_file() else {}
    (out / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.8, "top_k": 1}))
    return out


@pytest.fixture(scope="module")
def app(checkpoint):
    with app_in_process(checkpoint, MODEL, max_num_seqs=4, max_model_len=128) as (server, http, _):
        yield server, http


def completion(http, **body) -> str:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS,
                                                  "ignore_eos": True, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_a_request_without_top_k_decodes_greedily_as_the_checkpoint_says(app, checkpoint):
    _, http = app
    want = AutoTokenizer.from_pretrained(str(checkpoint)).decode(hf_greedy(checkpoint, PROMPT, TOKENS)[0],
                                                                 skip_special_tokens=True)
    assert completion(http, seed=11) == completion(http, temperature=0) == want
    card = http.get(f"/v1/models/{MODEL}").json()
    assert (card["sampling_defaults"], card["max_model_len"]) == ({"temperature": 0.8, "top_k": 1}, 128)


def test_a_value_the_request_sends_wins_over_the_checkpoints(app):
    server, http = app
    explicit = completion(http, top_k=0, seed=11)  # the checkpoint's temperature 0.8, no top-k
    defaults, server.sampling_defaults = server.sampling_defaults, {}
    try:
        assert completion(http, temperature=0.8, seed=11) == explicit
    finally:
        server.sampling_defaults = defaults
