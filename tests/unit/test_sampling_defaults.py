"""Sampling defaults from the checkpoint (serve_app.sampling_defaults): generation_config.json read,
the model config's `sampling_defaults` over it, applied to the fields a request did not send, and
listed in /v1/models; through a replica over tests/support/fake_engine.py's FakeEngine, whose
output tells greedy requests (the prompt from its first token) from sampled ones (shifted by the seed)."""

from __future__ import annotations

import json
import logging
import pickle
import shutil

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from engine.formats.checkpoint_config import generation_defaults
from serve_app.config import AppConfig, ModelConfig
from serve_app.http.backends import LocalBackend
from serve_app.http.ingress import create_app
from serve_app.protocol.chat import ChatCompletionRequest
from serve_app.protocol.completions import CompletionRequest
from serve_app.replicas.generate import TextServer
from serve_app.sampling_defaults import SamplingDefaults, effective_defaults

QWEN3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "bos_token_id": 1, "eos_token_id": 2}
"""Qwen3's generation_config.json (its sampling values and ids)."""


def read_defaults(directory) -> dict:
    """generation_config.json's values of the fields the config's sampling_defaults has."""
    return generation_defaults(directory, SamplingDefaults.model_fields)


def write_generation_config(directory, values: dict) -> None:
    (directory / "generation_config.json").write_text(json.dumps(values))


def test_generation_config_gives_its_sampling_values_and_nothing_else(tmp_path):
    assert read_defaults(tmp_path) == {}
    write_generation_config(tmp_path, {**QWEN3, "min_p": None, "max_new_tokens": 99, "repetition_penalty": 1.05})
    assert read_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}


def test_do_sample_false_is_not_read_as_vllm_does_not(tmp_path):
    write_generation_config(tmp_path, {"do_sample": False, "temperature": 0.7})
    assert effective_defaults("auto", read_defaults(tmp_path)) == {"temperature": 0.7}


def test_auto_none_and_a_mapping_over_the_checkpoint():
    checkpoint = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert effective_defaults("auto", checkpoint) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert effective_defaults("none", checkpoint) == {}
    mapping = SamplingDefaults.parse({"temperature": 0.7, "top_k": -1, "min_p": 0.05})
    assert effective_defaults(mapping, checkpoint) == {"temperature": 0.7, "top_p": 0.95, "top_k": 0, "min_p": 0.05}


def test_checkpoint_values_a_request_could_not_send_are_left_out_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, "serve_app.sampling_defaults"):
        got = effective_defaults("auto", {"temperature": -1, "top_p": 0.0, "repetition_penalty": 1.1})
    assert got == {"repetition_penalty": 1.1}
    assert [r.getMessage().split(";")[0] for r in caplog.records] == [
        "generation_config.json.temperature = -1 is refused (Input should be greater than or equal to 0)",
        "generation_config.json.top_p = 0.0 is refused (Input should be greater than 0)",
    ]


@pytest.mark.parametrize("setting, message", [
    ({"temprature": 0.7}, "sampling_defaults has no field 'temprature'; its fields are temperature, top_p, top_k, "
                          "min_p, repetition_penalty"),
    ({"top_p": 1.5}, "sampling_defaults.top_p = 1.5 is refused (Input should be less than or equal to 1); change it"),
    ({"top_k": -2}, "sampling_defaults.top_k = -2 is refused (Input should be greater than or equal to -1)"),
    ("greedy", "sampling_defaults is 'greedy'; set it to auto (the checkpoint's generation_config.json), none"),
])
def test_bad_settings_are_refused_at_config_load_naming_what_to_change(setting, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        AppConfig.from_args({"model": "m", "sampling_defaults": setting})


def test_settings_from_the_command_line_and_other_tasks():
    model = AppConfig.from_args({"model": "m", "sampling_defaults": '{"temperature": "0", "top_k": 1}'}).models[0]
    assert model.sampling_defaults == SamplingDefaults(temperature=0.0, top_k=1)
    assert AppConfig.from_args({"model": "m", "sampling_defaults": "none"}).models[0].sampling_defaults == "none"
    assert ModelConfig(model="m").sampling_defaults == "auto"
    with pytest.raises(ValidationError, match="sampling_defaults applies to text generation models; 'm' is an "
                                              "embedding model: leave it out"):
        ModelConfig(model="m", task="embed", sampling_defaults={"temperature": 0.5})


def test_defaults_fill_only_the_fields_a_request_did_not_send():
    defaults = {"temperature": 0.0, "top_p": 0.5, "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.2}
    request = CompletionRequest.model_validate_json('{"model": "m", "prompt": "hi", "temperature": 1.0, "top_k": -1}')
    request = pickle.loads(pickle.dumps(request))  # as it crosses the Ray hop
    params = request.apply_defaults(request.to_sampling_params(), defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (
        1.0, 0.5, 0, 0.1, 1.2)
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], top_p=1.0)
    params = chat.apply_defaults(chat.to_sampling_params(default_max_tokens=8), defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (
        0.0, 1.0, 20, 0.1, 1.2)
    assert chat.apply_defaults(chat.to_sampling_params(default_max_tokens=8), {}).temperature == 1.0


@pytest.fixture(scope="module")
def greedy_checkpoint(llama_dir, tmp_path_factory):
    """The tiny Llama whose generation_config.json says temperature 0 (greedy) and top_k 20."""
    out = tmp_path_factory.mktemp("greedy-defaults") / "ckpt"
    shutil.copytree(llama_dir, out)
    write_generation_config(out, {"do_sample": True, "temperature": 0.0, "top_k": 20, "eos_token_id": 2})
    return out


@pytest.fixture(scope="module")
def client(greedy_checkpoint):
    args = {"engine_cls": "tests.support.fake_engine:FakeEngine", "max_num_seqs": 4, "max_model_len": 128}
    config = AppConfig.from_args({"models": [
        {"model": str(greedy_checkpoint), "model_id": "checkpoint", **args},
        {"model": str(greedy_checkpoint), "model_id": "mapping", "sampling_defaults": {"top_p": 0.9}, **args},
        {"model": str(greedy_checkpoint), "model_id": "openai", "sampling_defaults": "none", **args},
    ]})
    servers = {model.model_id: TextServer(model) for model in config.models}
    with TestClient(create_app({name: LocalBackend(s) for name, s in servers.items()})) as client:
        yield client
    for server in servers.values():
        server.driver.shutdown()


def completion_tokens(client, model: str, **body) -> list[int]:
    response = client.post("/v1/completions", json={"model": model, "prompt": [5, 6, 7, 8, 9], "max_tokens": 5,
                                                    "seed": 3, "logprobs": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def test_a_request_without_temperature_samples_as_the_checkpoint_says(client):
    greedy = completion_tokens(client, "checkpoint", temperature=0)
    assert completion_tokens(client, "checkpoint") == greedy  # the checkpoint's temperature 0
    assert completion_tokens(client, "mapping") == greedy  # the config's mapping keeps the checkpoint's temperature
    shifted = completion_tokens(client, "openai")  # OpenAI's temperature 1: sampled with seed 3
    assert completion_tokens(client, "checkpoint", temperature=1.0) == shifted  # an explicit value wins
    assert shifted == greedy[3:] + greedy[:3] != greedy


def test_models_lists_each_models_defaults_and_context(client):
    cards = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
    assert {name: card["sampling_defaults"] for name, card in cards.items()} == {
        "checkpoint": {"temperature": 0.0, "top_k": 20}, "mapping": {"temperature": 0.0, "top_k": 20, "top_p": 0.9},
        "openai": {}}
    assert {card["max_model_len"] for card in cards.values()} == {128}
    assert {card["dimensions"] for card in cards.values()} == {None}
    assert client.get("/v1/models/mapping").json()["sampling_defaults"] == cards["mapping"]["sampling_defaults"]
