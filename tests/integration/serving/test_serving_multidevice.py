"""End to end, several devices: the `multidevice` app (tests/support/serving_apps.py) on a real local
Ray Serve: a replica that splits the tiny Llama over two devices (read from S3, with a LoRA adapter
and n-gram speculation) and one over two host processes (downloaded from a Hub repo, with a draft
model), each answering as transformers or as the single-device replica of the `text` app does."""

from __future__ import annotations

import httpx
import pytest

from tests.support.serving_apps import (
    ADAPTER_TP2,
    HUB_REPO,
    MESSAGES,
    MODEL,
    MODEL_2HOSTS,
    MODEL_MOE,
    MODEL_TP2,
    PROMPT,
    S3_URI,
)
from tests.support.serving_helpers import (
    OpenStream,
    engine_worker_processes,
    ray_processes,
    samples,
    wait_for,
)
from tests.support.tiny_models import make_lora_adapter

openai = pytest.importorskip("openai")



@pytest.fixture(scope="module")
def client(multidevice_app):
    return multidevice_app.client


@pytest.fixture(scope="module")
def http(multidevice_app):
    return multidevice_app.http


def test_models(client, serving, checkpoint_factory):
    assert [m.id for m in client.models.list().data] == [MODEL_TP2, MODEL_2HOSTS, MODEL_MOE, ADAPTER_TP2]
    roots = {m.id: m.model_extra["root"] for m in client.models.list().data}
    assert roots == {MODEL_TP2: S3_URI, MODEL_2HOSTS: f"{HUB_REPO}@main",
                     MODEL_MOE: str(checkpoint_factory("qwen3_moe")), ADAPTER_TP2: str(serving.adapters / "every")}
    assert client.models.retrieve(ADAPTER_TP2).model_extra["parent"] == MODEL_TP2


def test_lora_adapters_through_ray_serve_answer_as_transformers_with_peft(client, http, serving):
    """An adapter of lora_modules and one loaded at run time, over the tensor-parallel model, each
    read by a Serve replica through Ray Serve's model multiplexing."""
    from tests.support.parity import peft_greedy

    prompt = serving.tokenizer.encode(PROMPT)
    attention = make_lora_adapter(serving.checkpoint, serving.adapters / "attention", rank=8, seed=2,
                                  targets=("q_proj", "v_proj"))
    loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "attn", "lora_path": str(attention),
                                                      "base_model_name": MODEL_TP2})
    assert loaded.status_code == 200, loaded.text
    try:
        for name, path in ((ADAPTER_TP2, serving.adapters / "every"), ("attn", attention)):
            answer = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
            want = peft_greedy(serving.checkpoint, path, prompt, 8)
            assert answer.choices[0].text == serving.tokenizer.decode(want, skip_special_tokens=True), name
            assert answer.model == name
    finally:
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "attn"}).status_code == 200
    assert http.post("/v1/completions", json={"model": "attn", "prompt": "x"}).status_code == 404


def test_a_hub_model_on_two_hosts_was_downloaded_once(serving, multidevice_app):
    """The leader fetched the repo; the workers (same host here) found its directory instead of fetching."""
    assert sorted(name for _, name in serving.hub.downloads) == sorted(
        ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
         "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"])
    assert set(serving.hub.downloads.values()) == {1}


def test_404_for_an_unknown_model_names_the_adapters_too(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-5", prompt="x")
    assert info.value.status_code == 404
    assert info.value.body == {
        "message": f"the model 'gpt-5' does not exist; served models: ['{MODEL_2HOSTS}', '{MODEL_TP2}', "
                   f"'{MODEL_MOE}']; "
                   f"LoRA adapters: ['{ADAPTER_TP2}']",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_a_tensor_parallel_replica_answers_as_the_single_device_one(client, http, text_app):
    """The TP=2 replica (2 host devices, the xla backend: the cpu kernels do not shard; speculative
    decoding by 1-token prompt lookup: a random model's output soon repeats a token, so rows carry
    guesses) gives the same greedy text, streamed or not, as the TP=1 replica (the cpu backend,
    no speculation), and says how it runs."""
    prompts = [PROMPT, "Once upon a time", "def add(a, b):"]
    for prompt in prompts:
        want = text_app.client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        got = client.completions.create(model=MODEL_TP2, prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage == want.usage
    want = text_app.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(model=MODEL_TP2, messages=MESSAGES, max_tokens=20, temperature=0,
                                            stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == \
        want.choices[0].message.content

    (tp1,) = samples(text_app.http, "jax_serve:engine_info", model_name=MODEL)
    (tp2,) = samples(http, "jax_serve:engine_info", model_name=MODEL_TP2)
    assert tp1.value == tp2.value == 1.0
    assert {k: tp1.labels[k] for k in ("tensor_parallel_size", "num_devices", "attention_backend", "mesh")} == {
        "tensor_parallel_size": "1", "num_devices": "1", "attention_backend": "cpu", "mesh": "data=1,model=1"}
    assert {k: tp2.labels[k] for k in ("tensor_parallel_size", "num_devices", "attention_backend", "mesh")} == {
        "tensor_parallel_size": "2", "num_devices": "2", "attention_backend": "xla", "mesh": "data=1,model=2"}
    assert tp1.labels["dtype"] == tp2.labels["dtype"] == "float32"  # dtype auto: the checkpoint's own
    (guessed,) = samples(http, "vllm:spec_decode_num_draft_tokens_total", model_name=MODEL_TP2)
    assert guessed.value > 0


def test_a_mixture_of_experts_split_over_two_devices_answers_as_transformers(serving, client, http,
                                                                            checkpoint_factory):
    """A Qwen3-MoE with expert parallelism (4 of its 8 experts on each device, the planner's
    choice): completions streamed or not are transformers' greedy tokens, and the info metric says
    how it runs."""
    import torch
    import transformers

    model_dir = checkpoint_factory("qwen3_moe")
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt in (PROMPT, "Once upon a time"):
        got = client.completions.create(model=MODEL_MOE, prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == serving.greedy_text(serving.tokenizer.encode(prompt), 12, reference)
    want = client.chat.completions.create(model=MODEL_MOE, messages=MESSAGES, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model=MODEL_MOE, messages=MESSAGES, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.choices[0].message.content
    (info,) = samples(http, "jax_serve:engine_info", model_name=MODEL_MOE)
    assert {k: info.labels[k] for k in ("tensor_parallel_size", "expert_parallel_size", "num_devices", "mesh")} == {
        "tensor_parallel_size": "2", "expert_parallel_size": "2", "num_devices": "2", "mesh": "data=1,model=2"}


def test_a_replica_over_two_hosts_answers_as_transformers(serving, client, http):
    """With speculative decoding by a draft model (the 4-head tiny Llama guessing for the 8-head one,
    each host holding its share of both), the tokens of decoding one at a time."""
    long = client.completions.create(model=MODEL_2HOSTS, prompt=PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert long.choices[0].text == serving.greedy_text(serving.tokenizer.encode(PROMPT), 40, serving.eight_heads)
    (guessed,) = samples(http, "vllm:spec_decode_num_draft_tokens_total", model_name=MODEL_2HOSTS)
    assert guessed.value > 0
    for prompt in (PROMPT, "Once upon a time"):
        prompt_ids = serving.tokenizer.encode(prompt)
        got = client.completions.create(model=MODEL_2HOSTS, prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == serving.greedy_text(prompt_ids, 12, serving.eight_heads)
    want = client.chat.completions.create(model=MODEL_2HOSTS, messages=MESSAGES, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model=MODEL_2HOSTS, messages=MESSAGES, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.choices[0].message.content
    seeded = client.completions.create(model=MODEL_2HOSTS, prompt=PROMPT, max_tokens=6, temperature=1.0, n=3, seed=7,
                                       extra_body={"ignore_eos": True})
    again = client.completions.create(model=MODEL_2HOSTS, prompt=PROMPT, max_tokens=6, temperature=1.0, n=3, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in seeded.choices] == [c.text for c in again.choices] and seeded.usage.completion_tokens == 18
    assert len(engine_worker_processes()) == 2


def test_two_hosts_show_in_the_info_metric(http, text_app):
    (info,) = samples(http, "jax_serve:engine_info", model_name=MODEL_2HOSTS)
    assert {k: info.labels[k] for k in ("num_hosts", "tensor_parallel_size", "num_devices", "mesh")} == {
        "num_hosts": "2", "tensor_parallel_size": "4", "num_devices": "4", "mesh": "data=1,model=4"}
    (single,) = samples(text_app.http, "jax_serve:engine_info", model_name=MODEL)
    assert single.labels["num_hosts"] == "1"


def test_replicas_over_two_hosts_scale_as_whole_groups(serving, multidevice_app, checkpoint_factory):
    """Each replica with num_hosts 2 owns one placement group (leader + 2 worker bundles) and its
    two EngineWorkers: two replicas run four workers in two more groups; scaling to one stops a whole
    group (no half-alive pair, no leaked group) and keeps the other replica running; deleting the
    app leaves only the other app's. Deployed as `serve deploy` does, from a Serve config whose
    `deployments:` sets the replica count: a change there scales the running app (a change under
    `args` would be a new version of it, every replica restarted)."""
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    def created_groups() -> int:
        return sum(g["state"] == "CREATED" for g in ray.util.placement_group_table().values())

    def deploy(replicas: int) -> None:
        model = {"model": str(checkpoint_factory("llama")), "model_id": "scaled", "max_num_seqs": 2,
                 "max_model_len": 64, "max_num_batched_tokens": 64, "prefill_chunk": 32, "warmup": False,
                 "num_hosts": 2, "tensor_parallel_size": 2, "num_cpus": 0.1}
        app = {"name": "scaled", "route_prefix": "/scaled", "import_path": "serve_app:build_app",
               "runtime_env": {"env_vars": {"USE_TORCH": "0", "HF_HUB_OFFLINE": "1"}},
               "args": {"models": [model], "ingress_num_cpus": 0.05},
               "deployments": [{"name": "TextServer-scaled", "num_replicas": replicas}]}
        _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": [app]}))

    def running() -> bool:
        app = serve.status().applications.get("scaled")
        return app is not None and app.status == "RUNNING"

    workers, groups = len(engine_worker_processes()), created_groups()
    try:
        deploy(2)
        wait_for(lambda: len(engine_worker_processes()) == workers + 4 and running(), 120, "two groups of two workers")
        assert created_groups() == groups + 2
        answer = httpx.post(f"{serving.url}/scaled/v1/completions", timeout=60,
                            json={"model": "scaled", "prompt": PROMPT, "max_tokens": 3, "temperature": 0})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
        servers = {p.pid for p in ray_processes(r"ray::ServeReplica:scaled:TextServer-scaled")}
        deploy(1)
        wait_for(lambda: len(engine_worker_processes()) == workers + 2 and created_groups() == groups + 1, 120,
                 "one group of two workers")
        kept = {p.pid for p in ray_processes(r"ray::ServeReplica:scaled:TextServer-scaled")}
        assert len(kept) == 1 and kept <= servers  # scaled down, not redeployed
    finally:
        serve.delete("scaled")
    wait_for(lambda: len(engine_worker_processes()) == workers and created_groups() == groups, 120,
             "the other app's workers and groups only")


def test_a_killed_worker_restarts_the_whole_group(serving, multidevice_app, client, http):
    """SIGKILL one EngineWorker while a stream is open: the stream ends with an OpenAI error event
    and [DONE], /health turns 503, Ray Serve restarts the replica with a fresh pair of workers, and
    requests succeed again. (Last in this file: the app is unhealthy for a while.)"""
    import os
    import signal

    from tests.support.serving_helpers import sse_events

    stream = OpenStream(http, MODEL_2HOSTS, PROMPT, max_tokens=400)
    before = engine_worker_processes()
    os.kill(before[0].pid, signal.SIGKILL)
    events = sse_events(stream.lines)  # reads to the end of the stream: it must end, not hang
    assert events[-1] == "[DONE]" and "error" in events[-2]
    assert events[-2]["error"]["type"] == "server_error"
    health = f"{multidevice_app.url}/health"
    wait_for(lambda: httpx.get(health).status_code == 503, 30, "/health to report the lost host")
    wait_for(lambda: httpx.get(health).status_code == 200, 180, "the replica to come back")
    after = engine_worker_processes()
    assert len(after) == 2 and not {p.pid for p in after} & {p.pid for p in before}
    got = client.completions.create(model=MODEL_2HOSTS, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == serving.greedy_text(serving.tokenizer.encode(PROMPT), 12, serving.eight_heads)
