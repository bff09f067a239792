"""LoRA adapters through the OpenAI app (the official client against the real engine, in this
process): selected by `model`, listed in /v1/models with their parent, loaded and unloaded at run
time with vLLM's routes, held by the replica least recently used first."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from tests.support.parity import hf_greedy, peft_greedy
from tests.support.serving_helpers import app_in_process, wait_for
from tests.support.tiny_models import make_lora_adapter

MODEL = "tiny-llama"
PROMPT = [17, 42, 99, 7, 250, 31, 64]
TOKENS = 8


@pytest.fixture(scope="module")
def app(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    paths = {"every": make_lora_adapter(llama_dir, root / "every", rank=4, seed=1),
             "attention": make_lora_adapter(llama_dir, root / "attention", rank=8, seed=2,
                                            targets=("q_proj", "k_proj", "v_proj", "o_proj")),
             "third": make_lora_adapter(llama_dir, root / "third", rank=2, seed=3)}
    with app_in_process(llama_dir, MODEL, max_num_seqs=4, lora_modules={"every": str(paths["every"])},
                        max_loras=2, max_lora_rank=8, max_cpu_loras=2) as (server, http, client):
        yield server, http, client, paths


def text_of(llama_dir, tokens: list[int]) -> str:
    return AutoTokenizer.from_pretrained(str(llama_dir)).decode(tokens, skip_special_tokens=True)


def complete(client, model: str, stream: bool = False) -> str:
    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=stream)
    if stream:
        return "".join(chunk.choices[0].text for chunk in answer if chunk.choices)
    assert answer.model == model
    return answer.choices[0].text


def test_an_adapter_named_as_model_answers_as_transformers_with_peft(app, llama_dir):
    _, _, client, paths = app
    want = text_of(llama_dir, peft_greedy(llama_dir, paths["every"], PROMPT, TOKENS))
    assert complete(client, "every") == want
    assert complete(client, "every", stream=True) == want
    assert complete(client, MODEL) == text_of(llama_dir, hf_greedy(llama_dir, PROMPT, TOKENS)[0]) != want


def test_adapters_are_listed_with_their_parent(app):
    _, http, _, paths = app
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert cards["every"]["parent"] == MODEL and cards["every"]["root"] == str(paths["every"])
    assert cards[MODEL]["parent"] is None
    assert http.get("/v1/models/every").json()["parent"] == MODEL


def test_adapters_load_and_unload_at_run_time(app, llama_dir):
    _, http, client, paths = app
    load = {"lora_name": "attn", "lora_path": str(paths["attention"])}
    answer = http.post("/v1/load_lora_adapter", json=load)
    assert (answer.status_code, answer.text) == (200, "Success: LoRA adapter 'attn' added successfully.")
    chat = client.chat.completions.create(model="attn", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=TOKENS, temperature=0)
    assert chat.model == "attn"
    assert complete(client, "attn") == text_of(llama_dir, peft_greedy(llama_dir, paths["attention"], PROMPT, TOKENS))
    again = http.post("/v1/load_lora_adapter", json=load)
    assert again.status_code == 400
    assert again.json()["error"] == {"message": "the LoRA adapter 'attn' is already loaded; unload it first or send "
                                                "load_inplace: true", "type": "invalid_request_error",
                                     "param": "lora_name", "code": None}
    assert http.post("/v1/load_lora_adapter", json={**load, "load_inplace": True}).status_code == 200
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "attn"})
    assert (gone.status_code, gone.text) == (200, "Success: LoRA adapter 'attn' removed successfully.")
    with pytest.raises(openai.NotFoundError) as caught:
        complete(client, "attn")
    assert caught.value.body["code"] == "model_not_found"
    assert caught.value.body["message"] == (f"the model 'attn' does not exist; served models: ['{MODEL}']; "
                                            "LoRA adapters: ['every']")
    again = http.post("/v1/unload_lora_adapter", json={"lora_name": "attn"})
    assert again.status_code == 404
    assert again.json()["error"]["message"] == "the LoRA adapter 'attn' cannot be found"


def test_adapters_the_server_cannot_load_are_refused_with_why(app, llama_dir):
    _, http, _, _ = app
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(llama_dir)})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "lora_path"
    assert bad.json()["error"]["message"] == (f"LoRA adapter 'x': {llama_dir} is not a PEFT LoRA adapter: it has no "
                                              "adapter_config.json")
    clash = http.post("/v1/load_lora_adapter", json={"lora_name": MODEL, "lora_path": str(llama_dir)})
    assert clash.status_code == 400
    assert clash.json()["error"]["message"] == f"'{MODEL}' is the name of a served model; give the adapter another name"
    other = http.post("/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": "/x", "base_model_name": "nope"})
    assert other.status_code == 400
    assert other.json()["error"]["message"] == (f"base_model_name 'nope' is not a text generation model served "
                                                f"here; served: {MODEL}")
    assert "x" not in {card["id"] for card in http.get("/v1/models").json()["data"]}


def test_a_replica_holds_its_least_recently_used_adapters_only(app, llama_dir):
    server, http, client, paths = app
    for name in ("one", "two", "three"):
        path = paths["third"] if name == "three" else paths["attention"] if name == "two" else paths["every"]
        assert http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}).status_code == 200
    held = [key.split("@")[0] for key in server.driver.engine.adapters()]
    assert held == ["three", "two"]  # max_cpu_loras=2: "one" read first, gone first
    labels = '{model_name="tiny-llama",replica="local"}'
    wait_for(lambda: f"jax_serve:lora_adapters{labels} 2.0\n" in http.get("/metrics").text, 5,
             "the engine's next stats (every loop turn) to count the adapters")
    assert f"jax_serve:lora_slots_in_use{labels} 0.0\n" in http.get("/metrics").text
    assert complete(client, "one") == text_of(llama_dir, peft_greedy(llama_dir, paths["every"], PROMPT, TOKENS))
    assert sorted(key.split("@")[0] for key in server.driver.engine.adapters()) == ["one", "three"]
    for name in ("one", "two", "three"):
        http.post("/v1/unload_lora_adapter", json={"lora_name": name})


def test_an_adapter_evicted_while_a_request_holds_it_leaves_when_that_request_ends():
    """max_cpu_loras=1: reading b evicts a, but a request still leasing a keeps it in the engine
    until it ends; reading a again afterwards brings it back."""
    import asyncio

    from serve_app.protocol.context import LoraRef
    from serve_app.replicas.adapters import ReplicaAdapters

    engine: list[str] = []
    adapters = ReplicaAdapters(lambda key, path: engine.append(key), engine.remove, max_loaded=1)
    a, b = LoraRef("a", "/a"), LoraRef("b", "/b")

    async def scenario():
        async with adapters.lease(a) as key_a:
            async with adapters.lease(b) as key_b:
                assert engine == [key_a, key_b]  # a evicted from the replica's LRU, still leased
            assert engine == [key_a, key_b]  # b is the one held
        assert engine == [key_b]  # a's lease ended: its eviction takes effect
        async with adapters.lease(a):
            assert engine == [key_a]  # read again; b evicted at once (not leased)

    asyncio.run(scenario())
