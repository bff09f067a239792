"""End to end: a real local Ray Serve application with the real engine on a tiny random checkpoint,
driven through HTTP by the official `openai` client (and httpx where exact bytes matter).

Ray Serve starts once for the whole session (`serving`) and is shut down at its end. The app serves
the checkpoint twice, on one device and split over two (tensor_parallel_size 2, read from an S3
bucket: moto's server), a Llama with 8 query heads on a replica over two host processes (num_hosts 2,
downloaded from a Hugging Face Hub repo: tests/support/hub_server.py), and a slow fake engine whose
requests can hold a replica's slots (the 429 test). It has an API key, so every /v1
call authenticates, and small bounds (8 ongoing requests per replica, 8 queued) so that the 429
path can be reached. (Ray Serve counts a request as queued until it is assigned to a
replica, so a burst can be turned away even when slots are free: the queue bound must exceed the
largest burst a test sends.) Reference outputs come from transformers running the
same checkpoint (greedy decoding and prompt logprobs).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import re
import socket
import types
from pathlib import Path

import httpx
import pytest

from tests.support.fake_engine import FAIL, FAULT_MARK, HANG
from tests.support.hub_server import HubServer
from tests.support.s3_server import S3Server
from tests.support.serving_helpers import (
    engine_worker_processes,
    model_server_processes,
    ray_processes,
    wait_for,
)
from tests.support.tiny_models import make_lora_adapter

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


API_KEY = "test-key"
MODEL = "tiny-llama"
MODEL_TP2 = "tiny-llama-tp2"
ADAPTER_TP2 = "tp2-lora"
"""A LoRA adapter over MODEL_TP2 (listed in its lora_modules)."""
"""The same checkpoint, copied from `S3_URI`, on a replica that splits it over 2 host devices
(tensor_parallel_size 2)."""
S3_URI = "s3://models/team/tiny-llama"
MODEL_2HOSTS = "tiny-llama-2hosts"
"""A Llama with 8 query / 2 KV heads, downloaded from the Hub repo `HUB_REPO`, on a replica over two
host processes (num_hosts 2): the leader schedules, two EngineWorkers with 2 host CPU devices each
hold it split over 4 (gloo collectives)."""
HUB_REPO = "test-org/tiny-llama-8heads"
EIGHT_HEADS = dict(hidden_size=128, num_heads=8, num_kv_heads=2, intermediate_size=256)
MODEL_SLOW = "slow-fake"
"""A replica whose engine is tests/support/fake_engine.py's SlowFakeEngine (20 ms a step): requests that
hold its slots for as long as a test needs, whatever the speed of the machine (the 429 test)."""
MODEL_PAIR = "pair-fake"
"""Two replicas of fake_engine.FakeEngine behind the prefix-affinity router."""
MODEL_FAULTY = "faulty-fake"
"""A replica whose engine (fake_engine.FaultyFakeEngine) fails or hangs when a test asks it to, with
a 2 s step watchdog, health checks every 1 s that fail after 5 s, 5 s to shut down, and streams the
ingress ends after 3 s of silence (keepalives every 0.5 s)."""
MODEL_WHISPER = "tiny-whisper"
"""tiny_models.make_whisper_checkpoint: /v1/audio/* on its own replica, beside the text models."""
MODEL_LLAVA = "tiny-llava"
"""tiny_models.make_llava_checkpoint: chat with image_url parts."""
MAX_MODEL_LEN = 512
REPO = Path(__file__).parents[2]
FAKES = "tests.support.fake_engine"
"""The fake engines' module (`engine_cls` FAKES:Class; the replicas find it with the repository on PYTHONPATH)."""
DEFAULT_APP = REPO / "deploy" / "config.yaml"
MAX_ONGOING = 8
MAX_QUEUED = 8
EXTRA = 14
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serving(checkpoint_factory, tmp_path_factory, whisper_dir, llava_dir):
    import ray
    import yaml
    from ray import serve

    from serve_app import build_app

    checkpoint = checkpoint_factory("llama")
    eight_heads = checkpoint_factory("llama", **EIGHT_HEADS)
    sources = contextlib.ExitStack()  # the Hub and the S3 bucket that two of the models come from
    hub = HubServer()
    sources.callback(hub.close)
    hub.add(HUB_REPO, eight_heads)
    hub_env = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path_factory.mktemp("hf"))}
    s3 = sources.enter_context(S3Server())
    s3.upload(checkpoint, S3_URI)
    # the default app's embedding model, as deploy/config.yaml configures it (compiled on first use)
    embedder = yaml.safe_load(DEFAULT_APP.read_text())["applications"][0]["args"]["models"][1]
    port = free_port()
    # USE_TORCH=0 as deploy/config.yaml sets it: no serving process runs a torch model, and each of
    # the ~15 this app starts at once would import torch through transformers (~2.5 s of CPU each)
    ray.init(address="local", num_cpus=5, include_dashboard=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "USE_TORCH": "0"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine = {"max_num_seqs": 8, "max_model_len": MAX_MODEL_LEN, "max_num_batched_tokens": 256, "prefill_chunk": 64}
        two_devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
        tp2 = {"tensor_parallel_size": 2, "warmup": False, "env_vars": two_devices}
        two_hosts = {**tp2, "num_hosts": 2, "tensor_parallel_size": 4, "num_cpus": 0.4, "health_check_period_s": 1,
                     "env_vars": {**two_devices, **hub_env}}
        from_s3 = {"env_vars": {**two_devices, **s3.env}, "cache_dir": str(tmp_path_factory.mktemp("models"))}
        adapters = tmp_path_factory.mktemp("adapters")
        lora = {"lora_modules": {ADAPTER_TP2: str(make_lora_adapter(checkpoint, adapters / "every", seed=1))},
                "max_lora_rank": 8}
        app = build_app(
            {
                "api_key": API_KEY,
                "models": [
                    {"model": str(checkpoint), "model_id": MODEL, **engine, "max_ongoing_requests": MAX_ONGOING,
                     "max_queued_requests": MAX_QUEUED, "stream_batch_ms": 5},
                    {"model": S3_URI, "model_id": MODEL_TP2, **engine, **tp2, **from_s3, **lora, "stream_batch_ms": 5,
                     "speculative": {"method": "ngram", "num_tokens": 3, "prompt_lookup_min": 1}},
                    {"model": HUB_REPO, "model_id": MODEL_2HOSTS, **engine, **two_hosts, "stream_batch_ms": 5,
                     "speculative": {"method": "draft_model", "model": str(checkpoint), "num_tokens": 3}},
                    {"model": str(checkpoint), "model_id": MODEL_SLOW, **engine, "engine_cls": f"{FAKES}:SlowFakeEngine",
                     "env_vars": {"PYTHONPATH": str(REPO)}, "max_ongoing_requests": MAX_ONGOING,
                     "max_queued_requests": MAX_QUEUED, "stream_batch_ms": 5},
                    {"model": str(checkpoint), "model_id": MODEL_FAULTY, **engine, "engine_cls": f"{FAKES}:FaultyFakeEngine",
                     "env_vars": {"PYTHONPATH": str(REPO)}, "step_timeout_s": 2,
                     "health_check_period_s": 1, "health_check_timeout_s": 5, "graceful_shutdown_timeout_s": 5,
                     "num_cpus": 0.1, "stream_batch_ms": 5,
                     "stream_keepalive_s": 0.5, "stream_silence_timeout_s": 3},
                    {**embedder, "warmup": False, "num_cpus": 0.1},
                    {"model": str(whisper_dir), "model_id": MODEL_WHISPER, "max_num_seqs": 4, "num_cpus": 0.1,
                     "transcription_fallback": None},  # greedy windows, as the reference decodes
                    {"model": str(llava_dir), "model_id": MODEL_LLAVA, **engine, "num_cpus": 0.1, "warmup": False,
                     "cache_dir": str(tmp_path_factory.mktemp("llava-cache"))},
                    {"model": str(checkpoint), "model_id": MODEL_PAIR, **engine, "engine_cls": f"{FAKES}:FakeEngine",
                     "env_vars": {"PYTHONPATH": str(REPO)}, "num_replicas": 2, "num_cpus": 0.1},
                ],
            }
        )
        serve.run(app, name="llm", route_prefix="/")
        base_url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(f"{base_url}/health").status_code == 200, 120, "a healthy app")
        yield types.SimpleNamespace(
            url=base_url,
            tokenizer=transformers.AutoTokenizer.from_pretrained(checkpoint),
            model=transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval(),
            eight_heads=transformers.AutoModelForCausalLM.from_pretrained(eight_heads, dtype=torch.float32).eval(),
            checkpoint=checkpoint,
            hub=hub,
            adapters=adapters,
        )
    finally:
        serve.shutdown()
        ray.shutdown()
        sources.close()


@pytest.fixture(scope="session")
def client(serving):
    return openai.OpenAI(base_url=f"{serving.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(serving):
    with httpx.Client(base_url=serving.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
        yield http


# ---- references from transformers ----


@torch.no_grad()
def hf_greedy(serving, prompt_ids: list[int], count: int, model=None) -> list[int]:
    ids = torch.tensor([prompt_ids])
    for _ in range(count):
        next_id = (model or serving.model)(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt_ids) :].tolist()


@torch.no_grad()
def hf_prompt_logprobs(serving, prompt_ids: list[int]) -> list[float]:
    logprobs = torch.log_softmax(serving.model(torch.tensor([prompt_ids])).logits[0], dim=-1)
    return [logprobs[i - 1, t].item() for i, t in enumerate(prompt_ids) if i > 0]


def greedy_text(serving, prompt_ids: list[int], count: int, model=None) -> str:
    return serving.tokenizer.decode(hf_greedy(serving, prompt_ids, count, model), skip_special_tokens=True)


def metric(http, name: str, model_name: str = MODEL, **labels) -> float:
    """Sum of the samples of `name` (over replicas) of `model_name` whose labels include `labels`."""
    return sum(sample.value for sample in samples(http, name, model_name=model_name, **labels))


def samples(http, name: str, **labels) -> list:
    """The samples of `name` whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    return [sample for family in text_string_to_metric_families(http.get("/metrics").text)
            for sample in family.samples if sample.name == name and labels.items() <= sample.labels.items()]


def openai_error(message: str, param=None, type="invalid_request_error", code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---- completions and chat ----


def test_completion_matches_transformers_with_exact_usage(serving, client):
    prompt_ids = serving.tokenizer.encode(PROMPT)
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.choices[0].text == greedy_text(serving, prompt_ids, 8)
    assert response.choices[0].finish_reason == "length"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (
        len(prompt_ids),
        8,
        len(prompt_ids) + 8,
    )


def test_list_of_prompts_gives_one_choice_each(serving, client):
    prompts = [PROMPT, "Hello, world!"]
    response = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    expected = [greedy_text(serving, serving.tokenizer.encode(p), 5) for p in prompts]
    assert [(c.index, c.text) for c in response.choices] == list(enumerate(expected))
    assert response.usage.prompt_tokens == sum(len(serving.tokenizer.encode(p)) for p in prompts)
    assert response.usage.completion_tokens == 10


def test_chat_matches_transformers_with_the_template_and_usage(serving, client):
    prompt_ids = serving.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == greedy_text(serving, prompt_ids, 6)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt_ids), 6)


def test_streamed_completion_equals_the_full_one(client):
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**request)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **request))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.model_dump() == full.usage.model_dump()


def test_streamed_chat_equals_the_full_one(client):
    request = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(stream=True, **request))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


def test_n_choices_use_seed_plus_index_and_reproduce(client):
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    several = client.completions.create(n=3, seed=7, **request)
    again = client.completions.create(n=3, seed=7, **request)
    singles = [client.completions.create(seed=7 + i, **request).choices[0].text for i in range(3)]
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert [c.text for c in several.choices] == [c.text for c in again.choices] == singles
    assert several.usage.completion_tokens == 24


def test_stop_strings_cut_the_text(serving, client):
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**request).choices[0].text
    stop = text[6:9]
    response = client.completions.create(stop=["never in this text \u2603", stop], **request)
    assert response.choices[0].text == text[: text.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_completion_logprobs_shapes(client):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert len(logprobs.text_offset) == 6 and logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 2  # greedy: the chosen token is one of the two most likely
        assert top[token] == logprob == max(top.values())


def test_chat_logprobs_shapes(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert len(entry.top_logprobs) == 3
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (entry.token, entry.logprob)
        assert isinstance(entry.bytes, list)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt_like_transformers(serving, client, max_tokens):
    prompt_ids = serving.tokenizer.encode(PROMPT)
    response = client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=max_tokens, temperature=0, echo=True, logprobs=1
    )
    logprobs = response.choices[0].logprobs
    assert response.choices[0].text.startswith(PROMPT)
    assert len(logprobs.tokens) == len(prompt_ids) + max_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    reference = hf_prompt_logprobs(serving, prompt_ids)
    assert logprobs.token_logprobs[1 : len(prompt_ids)] == pytest.approx(reference, abs=1e-3)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt_ids), max_tokens)


def test_models(client, serving, whisper_dir, llava_dir):
    assert [m.id for m in client.models.list().data] == [MODEL, MODEL_TP2, MODEL_2HOSTS, MODEL_SLOW, MODEL_FAULTY,
                                                         "all-minilm-l6-v2", MODEL_WHISPER, MODEL_LLAVA, MODEL_PAIR,
                                                         ADAPTER_TP2]
    assert client.models.retrieve(MODEL).id == MODEL
    roots = {m.id: m.model_extra["root"] for m in client.models.list().data}
    assert roots == {MODEL: str(serving.checkpoint), MODEL_TP2: S3_URI, MODEL_2HOSTS: f"{HUB_REPO}@main",
                     MODEL_SLOW: str(serving.checkpoint), MODEL_FAULTY: str(serving.checkpoint),
                     "all-minilm-l6-v2": "all-minilm-l6-v2", MODEL_PAIR: str(serving.checkpoint),
                     MODEL_WHISPER: str(whisper_dir), MODEL_LLAVA: str(llava_dir),
                     ADAPTER_TP2: str(serving.adapters / "every")}
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


def test_a_hub_model_on_two_hosts_was_downloaded_once(serving):
    """The leader fetched the repo; the workers (same host here) found its directory instead of fetching."""
    assert sorted(name for _, name in serving.hub.downloads) == sorted(
        ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
         "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"])
    assert set(serving.hub.downloads.values()) == {1}


# ---- errors ----


def test_the_default_apps_embedding_model_puts_paraphrases_closest(client):
    """all-MiniLM-L6-v2 from the shipped config, next to the text models behind the same endpoint."""
    import numpy as np

    from engine.formats.model_sources import resolve_model

    texts = ["Paris is the capital of France", "The French capital is Paris", "Bananas are yellow"]
    response = client.embeddings.create(model="all-minilm-l6-v2", input=texts)
    paris, paraphrase, bananas = (np.array(d.embedding) for d in response.data)
    assert len(paris) == 384 and np.isclose(np.linalg.norm(paris), 1.0, atol=1e-5)
    assert paris @ paraphrase > 0.8 > 0.2 > paris @ bananas
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model("all-minilm-l6-v2"))
    assert response.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts) == 20
    tasks = {m.id: m.task for m in client.models.list().data}
    assert tasks["all-minilm-l6-v2"] == "embed" and tasks[MODEL] == "generate"


def test_speech_to_text_through_ray_serve(client, serving, whisper_dir):
    """A Whisper replica in the same app: the openai client's transcription and stream, and the
    speech model listed as such; its 30-second windows equal transformers' long-form generate."""
    import io
    import wave

    import numpy as np

    from serve_app.media.audio import log_mel

    samples = (np.random.RandomState(4).randn(16000 * 35) * 3000).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1), out.setsampwidth(2), out.setframerate(16000), out.writeframes(samples.tobytes())
    file = ("speech.wav", buffer.getvalue())
    answer = client.audio.transcriptions.create(model=MODEL_WHISPER, file=file, language="en",
                                                response_format="verbose_json",
                                                timestamp_granularities=["segment", "word"])
    model = transformers.WhisperForConditionalGeneration.from_pretrained(whisper_dir).eval()
    mel = log_mel(samples.astype(np.float32) / 32768, 80)
    with torch.no_grad():
        out = model.generate(torch.tensor(mel[None]), attention_mask=torch.ones((1, mel.shape[1]), dtype=torch.long),
                             language="en", task="transcribe", return_timestamps=True, return_segments=True,
                             return_token_timestamps=True)
    tokenizer, eot = transformers.AutoTokenizer.from_pretrained(whisper_dir), model.generation_config.eos_token_id
    segments = [s["tokens"].tolist() for s in out["segments"][0]]
    assert answer.text == tokenizer.decode([t for tokens in segments for t in tokens if t < eot]).strip()
    worded = [tokens for tokens in segments if tokenizer.decode([t for t in tokens if t < eot]).strip()]
    assert [s.tokens for s in answer.segments] == worded
    assert answer.duration == 35.0 and answer.language == "english"
    # each word ends where transformers' token timestamps say its last token ends
    ends = {round(min(float(t), 35.0), 2) for s in out["segments"][0] for t in s["token_timestamps"]}
    assert answer.words and {w.end for w in answer.words} <= ends
    assert "".join(w.word for w in answer.words) == "".join(answer.text.split())
    events = list(client.audio.transcriptions.create(model=MODEL_WHISPER, file=file, language="en", stream=True))
    assert events[-1].type == "transcript.text.done" and events[-1].text == answer.text
    assert "".join(e.delta for e in events[:-1]) == answer.text
    tasks = {m.id: m.task for m in client.models.list().data}
    assert tasks[MODEL_WHISPER] == "transcribe"
    with pytest.raises(openai.BadRequestError, match="speech-to-text model"):
        client.embeddings.create(model=MODEL_WHISPER, input="hello")


def test_chat_with_an_image_through_ray_serve(client, llava_dir):
    """A LLaVA replica in the same app: an image_url part crosses the Ray hops and the answer is
    transformers' greedy one."""
    from tests.support.parity import llava_greedy, png_data_uri

    uri, picture = png_data_uri(3)
    answer = client.chat.completions.create(
        model=MODEL_LLAVA, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri, "detail": "low"}},
                                               {"type": "text", "text": "Describe it."}]}])
    text, prompt_tokens = llava_greedy(llava_dir, [{"role": "user", "content": "<image>\nDescribe it."}], [picture], 6)
    assert answer.choices[0].message.content == text and answer.usage.prompt_tokens == prompt_tokens
    with pytest.raises(openai.BadRequestError, match="takes no images"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": uri}}]}])


def test_json_schema_and_a_named_tool_call_through_ray_serve(client):
    """Constrained decoding on the real replica (the random model says garbage otherwise)."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "n": {"type": "integer",
              "minimum": 0, "maximum": 9}}, "required": ["city", "n"], "additionalProperties": False}
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=3, temperature=1.0, n=2,
                                            max_tokens=40, response_format={
                                                "type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    for choice in answer.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)
    tool = {"type": "function", "function": {"name": "pick", "parameters": schema}}
    call = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[tool], seed=4, temperature=1.0,
                                          max_tokens=40, tool_choice={"type": "function", "function": {"name": "pick"}})
    assert call.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.choices[0].message.tool_calls[0].function.arguments), schema)


def test_400_for_a_prompt_that_does_not_fit(serving, http):
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 510, "max_tokens": 10})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert "510" in error["message"] and str(MAX_MODEL_LEN) in error["message"]


def test_400_for_unsupported_fields(http):
    response = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "audio": {"voice": "alloy"}}
    )
    assert (response.status_code, response.json()) == (
        400,
        openai_error("'audio' is not supported yet", "audio"),
    )


def test_401_without_the_right_key(serving):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(f"{serving.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{serving.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_404_for_an_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-5", prompt="x")
    assert info.value.status_code == 404
    assert info.value.body == {
        "message": "the model 'gpt-5' does not exist; served models: ['all-minilm-l6-v2', "
                   f"'{MODEL_FAULTY}', '{MODEL_PAIR}', '{MODEL_SLOW}', '{MODEL}', '{MODEL_2HOSTS}', '{MODEL_TP2}', "
                   f"'{MODEL_LLAVA}', '{MODEL_WHISPER}']; "
                   "LoRA adapters: "
                   f"['{ADAPTER_TP2}']",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


class OpenStream:
    """A long streamed completion (seconds of engine steps), read up to its first event and held open
    until `close()`."""

    def __init__(self, http, max_tokens: int = 480, model: str = MODEL):
        request = http.build_request(
            "POST",
            "/v1/completions",
            json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True},
        )
        self.response = http.send(request, stream=True)
        assert self.response.status_code == 200
        self.lines = self.response.iter_lines()  # dropping this iterator would close the response
        assert next(line for line in self.lines if line).startswith("data: {")

    def close(self) -> None:
        self.response.close()


def test_429_with_retry_after_when_the_queue_is_full(http):
    """Ray Serve's backpressure through the ingress. The slot holders run on the slow fake engine
    (~10 s for 480 tokens), so they outlast the burst on any machine."""
    streams = [OpenStream(http, model=MODEL_SLOW) for _ in range(MAX_ONGOING)]  # every slot of the replica is busy
    try:
        with concurrent.futures.ThreadPoolExecutor(EXTRA) as pool:
            futures = [
                pool.submit(http.post, "/v1/completions", json={"model": MODEL_SLOW, "prompt": PROMPT, "max_tokens": 2})
                for _ in range(EXTRA)
            ]
            # At most MAX_QUEUED wait in the queue; the others are turned away at once.
            wait_for(lambda: sum(f.done() for f in futures) >= EXTRA - MAX_QUEUED, 60, "the rejections")
            for stream in streams:
                stream.close()  # frees the slots: the queued requests run
            responses = [f.result() for f in futures]
    finally:
        for stream in streams:
            stream.close()
    rejected = [r for r in responses if r.status_code == 429]
    assert len(rejected) >= EXTRA - MAX_QUEUED
    assert all(r.status_code == 200 for r in responses if r not in rejected)
    for response in rejected:
        assert response.headers["retry-after"] == "1"
        assert response.json() == openai_error(
            "the server is at capacity (Request dropped due to backpressure (num_queued_requests=8, "
            "max_queued_requests=8).); retry later",
            type="rate_limit_error",
            code="rate_limit_exceeded",
        )


# ---- disconnects and metrics ----


def test_a_disconnected_stream_is_aborted_and_frees_its_kv_pages(http):
    # Streams an earlier test closed are counted as Ray tears them down: take the baseline once the
    # engine is idle (a closed stream's abort is counted before its engine request ends).
    wait_for(lambda: metric(http, "vllm:num_requests_running") == metric(http, "vllm:num_requests_waiting") == 0,
             60, "an idle engine")
    aborted_before = metric(http, "vllm:request_success_total", finished_reason="abort")
    stream = OpenStream(http)
    assert metric(http, "vllm:kv_cache_usage_perc") > 0
    stream.close()
    wait_for(
        lambda: metric(http, "vllm:request_success_total", finished_reason="abort") == aborted_before + 1,
        60,
        "the abort to be counted",
    )
    wait_for(lambda: metric(http, "vllm:kv_cache_usage_perc") == 0, 60, "all KV pages to be free")
    assert metric(http, "vllm:num_requests_running") == 0


def test_metrics_count_requests_and_tokens(serving, http):
    before = {
        "length": metric(http, "vllm:request_success_total", finished_reason="length"),
        "prompt": metric(http, "vllm:prompt_tokens_total"),
        "generated": metric(http, "vllm:generation_tokens_total"),
        "e2e": metric(http, "vllm:e2e_request_latency_seconds_count"),
        "ttft": metric(http, "vllm:time_to_first_token_seconds_count"),
        "itl": metric(http, "vllm:inter_token_latency_seconds_count"),
        "queue": metric(http, "vllm:request_queue_time_seconds_count"),
    }
    for _ in range(3):
        response = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True}
        )
        assert response.status_code == 200
    prompt_tokens = len(serving.tokenizer.encode(PROMPT))
    assert metric(http, "vllm:request_success_total", finished_reason="length") == before["length"] + 3
    assert metric(http, "vllm:prompt_tokens_total") == before["prompt"] + 3 * prompt_tokens
    assert metric(http, "vllm:generation_tokens_total") == before["generated"] + 15
    assert metric(http, "vllm:e2e_request_latency_seconds_count") == before["e2e"] + 3
    assert metric(http, "vllm:time_to_first_token_seconds_count") == before["ttft"] + 3
    assert metric(http, "vllm:inter_token_latency_seconds_count") == before["itl"] + 3 * 4  # every token after the first
    assert metric(http, "vllm:request_queue_time_seconds_count") == before["queue"] + 3
    assert metric(http, "vllm:prefix_cache_queries_total") > 0
    assert metric(http, "vllm:num_requests_waiting") == metric(http, "vllm:num_requests_running") == 0
    assert metric(http, "vllm:kv_cache_usage_perc") == 0


def test_concurrent_requests_share_engine_steps(http):
    """Six streams through Ray Serve to one replica, each past its first token and far from its
    480th (the slow fake engine: ~10 s each), are one batch: the engine's next step runs all six.
    Closing them frees every slot and page. (Six, not the replica's eight slots: with eight, Serve
    held the eighth back until one ended, once earlier tests had run; seen, not yet explained.)"""
    streams = [OpenStream(http, model=MODEL_SLOW) for _ in range(6)]
    try:
        wait_for(lambda: metric(http, "vllm:num_requests_running", MODEL_SLOW) == 6, 30, "all six to run")
        steps = metric(http, "vllm:engine_steps_total", MODEL_SLOW)
        wait_for(lambda: metric(http, "vllm:engine_steps_total", MODEL_SLOW) > steps, 30, "a step after all started")
        assert metric(http, "vllm:last_batch_size", MODEL_SLOW) == 6
    finally:
        for stream in streams:
            stream.close()
    wait_for(lambda: metric(http, "vllm:num_requests_running", MODEL_SLOW) == 0
             and metric(http, "vllm:kv_cache_usage_perc", MODEL_SLOW) == 0, 30, "the closed streams' requests to end")


def test_health_needs_no_key_and_reports_the_step_programs_compiled(serving, http):
    """The real replica serves from its first step program and compiles the other six of its
    ladder (1, 8, ..., 256 tokens) in the background; /health and /metrics say how far it is."""
    response = httpx.get(f"{serving.url}/health")
    assert response.status_code == 200
    models = response.json()["models"]
    assert models[MODEL]["replicas"] == 1 and models[MODEL]["step_programs"] == 7
    assert models[MODEL_SLOW] == {"state": "ready", "replicas": 1}  # a fake engine compiles nothing ahead
    wait_for(lambda: httpx.get(f"{serving.url}/health").json()["models"][MODEL]["compiled_programs"] == 7, 300,
             "every step program")
    assert metric(http, "jax_serve:compiled_step_programs", MODEL) == metric(http, "jax_serve:step_programs", MODEL) == 7


# ---- tensor parallelism ----


def test_a_tensor_parallel_replica_answers_as_the_single_device_one(serving, client, http):
    """The TP=2 replica (2 host devices, the xla backend: the cpu kernels do not shard; speculative
    decoding by 1-token prompt lookup: a random model's output soon repeats a token, so rows carry
    guesses) gives the same greedy text, streamed or not, as the TP=1 replica (the cpu backend,
    no speculation), and says how it runs."""
    prompts = [PROMPT, "Once upon a time", "def add(a, b):"]
    for prompt in prompts:
        want = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        got = client.completions.create(model=MODEL_TP2, prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage == want.usage
    want = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(model=MODEL_TP2, messages=MESSAGES, max_tokens=20, temperature=0,
                                            stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == \
        want.choices[0].message.content

    (tp1,) = samples(http, "jax_serve:engine_info", model_name=MODEL)
    (tp2,) = samples(http, "jax_serve:engine_info", model_name=MODEL_TP2)
    assert tp1.value == tp2.value == 1.0
    assert {k: tp1.labels[k] for k in ("tensor_parallel_size", "num_devices", "attention_backend", "mesh")} == {
        "tensor_parallel_size": "1", "num_devices": "1", "attention_backend": "cpu", "mesh": "data=1,model=1"}
    assert {k: tp2.labels[k] for k in ("tensor_parallel_size", "num_devices", "attention_backend", "mesh")} == {
        "tensor_parallel_size": "2", "num_devices": "2", "attention_backend": "xla", "mesh": "data=1,model=2"}
    assert tp1.labels["dtype"] == tp2.labels["dtype"] == "float32"  # dtype auto: the checkpoint's own
    (guessed,) = samples(http, "vllm:spec_decode_num_draft_tokens_total", model_name=MODEL_TP2)
    assert guessed.value > 0


@pytest.mark.parametrize("fault,cause", [(FAIL, "RuntimeError('simulated device failure')"),
                                         (HANG, "TimeoutError('an engine step has not returned for")])
def test_a_failed_or_hung_engine_ends_every_request_and_its_replica_restarts(serving, http, fault, cause):
    """The engine fails (a step raises) or hangs (a step never returns; the 2 s watchdog finds it):
    a stream already running ends with an error event and [DONE], the request that set it off gets a
    503, /health names the model and the cause, Ray Serve restarts the replica, and the next request
    succeeds."""
    from tests.support.serving_helpers import sse_events

    running = OpenStream(http, max_tokens=400, model=MODEL_FAULTY)
    faulty = http.post("/v1/completions", json={"model": MODEL_FAULTY, "prompt": [FAULT_MARK, fault], "max_tokens": 3})
    assert faulty.status_code == 503
    assert faulty.json()["error"]["message"].startswith(f"engine loop died: {cause}")
    events = sse_events(running.lines)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "service_unavailable"
    assert events[-2]["error"]["message"].startswith(f"engine loop died: {cause}")
    health = httpx.get(f"{serving.url}/health")
    if health.status_code == 503:  # else Serve has already replaced the replica
        assert health.json()["error"]["message"].startswith(f"model '{MODEL_FAULTY}' is not ready: ")
    wait_for(lambda: httpx.get(f"{serving.url}/health").status_code == 200, 120, "the replica to come back")
    again = http.post("/v1/completions", json={"model": MODEL_FAULTY, "prompt": [5, 6, 7], "max_tokens": 3})
    assert (again.status_code, again.json()["choices"][0]["text"]) == (200, serving.tokenizer.decode([5, 6, 7]))


def test_a_stream_queued_without_output_is_kept_alive(serving, http):
    """Eight streams fill the faulty-fake replica's engine (~10 s each); a ninth waits in its queue
    with no output for far longer than the 3 s silence timeout. The replica's keepalives keep it
    open, and it runs to its end once a slot frees."""
    from tests.support.serving_helpers import sse_events

    holders = [OpenStream(http, model=MODEL_FAULTY) for _ in range(8)]
    try:
        waiting = http.post("/v1/completions", json={"model": MODEL_FAULTY, "prompt": [5, 6, 7], "max_tokens": 3,
                                                     "stream": True})
        events = sse_events(waiting.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == serving.tokenizer.decode([5, 6, 7])
    finally:
        for holder in holders:
            holder.close()


def test_a_frozen_replica_ends_its_streams_and_is_replaced(serving, http):
    """SIGSTOP the faulty-fake replica's process with a stream open: nothing, not even a keepalive,
    comes from it, so after 3 s the ingress ends the stream with a 503 error event and [DONE]; Serve
    replaces the frozen replica and requests succeed again."""
    import os
    import signal

    import psutil

    from tests.support.serving_helpers import sse_events

    stream = OpenStream(http, model=MODEL_FAULTY)
    (replica,) = model_server_processes(MODEL_FAULTY)
    os.kill(replica.pid, signal.SIGSTOP)
    try:
        events = sse_events(stream.lines)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "service_unavailable"
        assert events[-2]["error"]["message"] == ("the model server sent nothing for 3 s, not even a keepalive: it is "
                                                  "stuck or gone; retry")
        # /health waits up to 10 s for each replica's answer: the frozen one's never comes
        wait_for(lambda: httpx.get(f"{serving.url}/health", timeout=30).status_code == 200
                 and not replica.is_running(), 240, "Serve to replace the frozen replica")
    finally:
        with contextlib.suppress(psutil.Error):
            replica.send_signal(signal.SIGCONT)
    again = http.post("/v1/completions", json={"model": MODEL_FAULTY, "prompt": [5, 6, 7], "max_tokens": 3})
    assert (again.status_code, again.json()["choices"][0]["text"]) == (200, serving.tokenizer.decode([5, 6, 7]))


def drain_app(checkpoint: Path, graceful_shutdown_timeout_s: float):
    from serve_app import build_app

    model = {"model": str(checkpoint), "model_id": "draining", "engine_cls": f"{FAKES}:SlowFakeEngine",
             "env_vars": {"PYTHONPATH": str(REPO)}, "max_num_seqs": 8, "max_model_len": 4096,
             "num_cpus": 0.1, "stream_batch_ms": 5, "graceful_shutdown_timeout_s": graceful_shutdown_timeout_s}
    return build_app({"models": [model], "ingress_num_cpus": 0.05})


def open_streams(url: str, count: int, max_tokens: int) -> list:
    """`count` streamed completions, each read up to its first event."""
    streams = []
    for _ in range(count):
        response = httpx.Client(timeout=120).send(httpx.Request(
            "POST", f"{url}/v1/completions",
            json={"model": "draining", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
                  "ignore_eos": True, "stream_options": {"include_usage": True}}), stream=True)
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
        streams.append(lines)
    return streams


@pytest.mark.parametrize("timeout_s,max_tokens", [(30, 150), (1, 4000)])
def test_a_replica_shut_down_lets_its_streams_finish_or_ends_them_at_the_timeout(serving, checkpoint_factory,
                                                                                timeout_s, max_tokens):
    """Deleting the app (a replica stopping, as on scale-down or a redeploy) with 4 streams open:
    with time enough (150 tokens at 20 ms a step, 30 s allowed), Serve waits and every stream ends
    with its full length and [DONE] before the replica goes; with 1 s allowed for 4000 tokens, each
    ends early with an OpenAI error event and [DONE]. No client is left waiting."""
    from ray import serve

    from tests.support.serving_helpers import sse_events

    serve.run(drain_app(checkpoint_factory("llama"), timeout_s), name="draining", route_prefix="/draining")
    streams = open_streams(f"{serving.url}/draining", 4, max_tokens)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        deleted = pool.submit(serve.delete, "draining")
        events = [sse_events(lines) for lines in streams]
        deleted.result(timeout=120)
    for stream in events:
        assert stream[-1] == "[DONE]"
        if timeout_s == 30:
            assert stream[-3]["choices"][0]["finish_reason"] == "length"
            assert stream[-2]["usage"]["completion_tokens"] == max_tokens
        else:
            assert stream[-2]["error"]["code"] == "service_unavailable"
            assert stream[-2]["error"]["message"].startswith("the model server stopped while serving this request")


def test_a_soak_of_mixed_requests_loses_nothing_and_leaves_every_replica_idle(serving, http):
    """benchmarks/soak.py in-process on the tiny model: 300 requests at concurrency 32 (completions and
    chat, streamed or not, 60 with n=3, 75 with logprobs; 30 streams of 128 tokens the client closes
    after 1 to 3 events, 30 requests it gives up on after at most 0.1 s). Beyond 8 ongoing + 8 queued, Ray Serve
    answers 429: the soak retries after Retry-After, so every request runs. No 5xx, every stream
    not cut ends with [DONE], usage agrees with the tokens returned, and afterwards every replica of
    every model is back to 0 running, 0 waiting, 0 KV pages held."""
    import asyncio

    from benchmarks.soak import SoakConfig, format_report, soak

    pids = [p.pid for p in model_server_processes(MODEL)]
    assert len(pids) == 1
    wait_for(lambda: metric(http, "vllm:num_requests_running") == metric(http, "vllm:num_requests_waiting") == 0,
             60, "an idle engine")  # so that the server's counts below are the soak's alone
    config = SoakConfig(base_url=serving.url, model=MODEL, api_key=API_KEY, requests=300, concurrency=32,
                        max_tokens=8, disconnect_fraction=0.1, timeout_fraction=0.1, multi_fraction=0.2, n=3,
                        logprobs_fraction=0.25, client_timeout_s=0.1, retry_429=True, seed=0, pids=pids)
    report = asyncio.run(soak(config))
    print(format_report(report))
    assert report.actions == {"disconnect": 30, "normal": 240, "timeout": 30}
    assert sum(report.kinds.values()) == 300 and report.multi_choice == 60
    assert sum(count for kind, count in report.kinds.items() if kind.endswith("-stream")) == 30 + 135
    assert sum(count for kind, count in report.kinds.items() if kind.startswith("chat")) == 150
    by_action = report.outcomes_by_action()
    assert by_action["normal"] == {"ok": 240}
    # a cut or a timeout can come after the answer is complete: then it is checked like any other
    assert set(by_action["disconnect"]) <= {"ok", "disconnected"} and sum(by_action["disconnect"].values()) == 30
    assert set(by_action["timeout"]) <= {"ok", "timed_out"} and sum(by_action["timeout"].values()) == 30
    assert report.failures == [] and report.exit_code == 0
    assert report.idle is True and report.busy == []
    assert f"{MODEL}/" in " ".join(report.idle_series)
    assert set(report.memory_before) == set(report.memory_after) == {f"pid {pids[0]}"}
    # every choice of a request the client did not cut finished on the server; no other request did
    finished = report.server_finished
    assert set(finished) <= {"length", "abort"}
    assert sum(r.n for r in report.results if r.action == "normal") <= finished["length"]
    assert sum(finished.values()) <= sum(r.n for r in report.results)


# ---- routing ----


def requests_by_replica(http, model_id: str) -> dict[str, float]:
    """Finished requests of `model_id` per replica, from the app's /metrics."""
    counts: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("vllm:e2e_request_latency_seconds_count{") and f'model_name="{model_id}"' in line:
            replica = re.search(r'replica="([^"]+)"', line).group(1)
            counts[replica] = counts.get(replica, 0) + float(line.rsplit(" ", 1)[1])
    return counts


def test_each_turn_of_a_conversation_goes_to_the_replica_that_served_its_earlier_turns(http):
    """Two replicas behind the prefix-affinity router: a conversation's first turn goes where the
    power of two choices sends it, every later turn (its prompt extends the earlier ones) to the
    same replica. Left to chance, 4 conversations of 3 turns would stay together 1 time in 256."""
    system = "You answer questions about paged attention, page tables and prefix caches, briefly. " * 2
    for conversation in range(4):
        messages = [{"role": "system", "content": f"[{conversation}] {system}"}]
        before = requests_by_replica(http, MODEL_PAIR)
        for turn in range(3):
            messages.append({"role": "user", "content": f"Question {turn} of conversation {conversation}?"})
            answer = http.post("/v1/chat/completions", json={"model": MODEL_PAIR, "messages": messages,
                                                              "max_tokens": 6, "temperature": 0})
            assert answer.status_code == 200, answer.text
            messages.append({"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]})
        after = requests_by_replica(http, MODEL_PAIR)
        served = sorted(after[r] - before.get(r, 0) for r in after)
        assert served[-1] == 3 and sum(served) == 3, (conversation, before, after)


# ---- models that cannot start ----


def test_models_that_cannot_start_get_a_503_that_says_why_and_the_others_keep_serving(serving, checkpoint_factory,
                                                                                       tmp_path):
    """An app of four models: a healthy one, one whose replica waits at start until the test opens
    its gate, one whose tokenizer class no transformers knows and one whose
    config.json does not parse. Serve gives up on the last two after one try each
    (`max_constructor_retry_count: 1`; Serve's default is three); requests for
    them get a 503 in OpenAI's shape with Retry-After and the replica's own error, the starting one a
    503 that says so (until its gate opens), the healthy one answers throughout; /health and
    /v1/models show every state."""
    import json
    import shutil

    import openai
    from ray import serve

    from serve_app import build_app

    good = checkpoint_factory("llama")
    bad_tokenizer = Path(shutil.copytree(good, tmp_path / "bad-tokenizer"))
    config = json.loads((bad_tokenizer / "tokenizer_config.json").read_text())
    (bad_tokenizer / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "NoSuchTokenizer"}))
    bad_config = Path(shutil.copytree(good, tmp_path / "bad-config"))
    (bad_config / "config.json").write_text('{"model_type": "llama", ')
    gate = tmp_path / "gate"
    env = {"PYTHONPATH": str(REPO), "JAX_SERVE_TEST_GATE": str(gate)}
    fake = {"engine_cls": f"{FAKES}:FakeEngine", "env_vars": env, "num_cpus": 0.05, "max_model_len": 64}
    models = [{"model": str(good), "model_id": "healthy", **fake},
              {"model": str(good), "model_id": "gated", **fake, "engine_cls": f"{FAKES}:GatedFakeEngine"},
              {"model": str(bad_tokenizer), "model_id": "bad-tokenizer", **fake, "max_constructor_retry_count": 1},
              {"model": str(bad_config), "model_id": "bad-config", **fake, "max_constructor_retry_count": 1}]
    base = f"{serving.url}/startup"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    # serve.run waits for the app to run; with two models that never start it raises once Serve gives up
    deploying = concurrent.futures.ThreadPoolExecutor(1).submit(
        serve.run, build_app({"models": models, "ingress_num_cpus": 0.05}), name="startup", route_prefix="/startup")
    try:
        def states() -> dict:
            try:
                return {m.id: (m.model_extra["state"], m.model_extra["error"]) for m in client.models.list().data}
            except openai.APIError:
                return {}  # the ingress is not up yet

        wait_for(lambda: {s for s, _ in states().values()} == {"ready", "starting", "failed"}
                 and states()["bad-config"][0] == "failed" == states()["bad-tokenizer"][0], 300,
                 "both broken models to fail and the healthy one to run")
        tokenizer_error = "ValueError: Tokenizer class NoSuchTokenizer does not exist or is not currently imported."
        assert states() == {"healthy": ("ready", None), "gated": ("starting", None),
                            "bad-tokenizer": ("failed", tokenizer_error), "bad-config": ("failed", states()["bad-config"][1])}
        assert states()["bad-config"][1].startswith("JSONDecodeError: ")

        for model, message in (("bad-tokenizer", f"model 'bad-tokenizer' failed to start: {tokenizer_error}; fix its "
                                                 "configuration and redeploy"),
                               ("gated", "model 'gated' is starting (loading and compiling); retry shortly")):
            response = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 2})
            assert (response.status_code, response.headers["retry-after"]) == (503, "1")
            assert response.json() == {"error": {"message": message, "type": "server_error", "param": None,
                                                 "code": "service_unavailable"}}
        with pytest.raises(openai.InternalServerError, match="JSONDecodeError"):
            client.chat.completions.create(model="bad-config", messages=MESSAGES, max_tokens=2)
        ok = client.completions.create(model="healthy", prompt=PROMPT, max_tokens=3, temperature=0)
        assert ok.usage.completion_tokens == 3

        health = httpx.get(f"{base}/health")
        assert health.status_code == 503
        assert {m: h["state"] for m, h in health.json()["models"].items()} == {
            "healthy": "ready", "gated": "starting", "bad-tokenizer": "failed", "bad-config": "failed"}
        assert tokenizer_error in health.json()["error"]["message"]

        gate.touch()  # the starting replica finishes its start
        wait_for(lambda: states().get("gated", ("", None))[0] == "ready", 120, "the gated model to start")
        assert client.completions.create(model="gated", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(RuntimeError):  # Serve reports the two it gave up on to the deployer, too
            deploying.result(timeout=300)
    finally:
        gate.touch()
        serve.delete("startup")


# ---- a replica over two hosts ----


def test_a_replica_over_two_hosts_answers_as_transformers(serving, client, http):
    """With speculative decoding by a draft model (the 4-head tiny Llama guessing for the 8-head one,
    each host holding its share of both), the tokens of decoding one at a time."""
    long = client.completions.create(model=MODEL_2HOSTS, prompt=PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert long.choices[0].text == greedy_text(serving, serving.tokenizer.encode(PROMPT), 40, serving.eight_heads)
    (guessed,) = samples(http, "vllm:spec_decode_num_draft_tokens_total", model_name=MODEL_2HOSTS)
    assert guessed.value > 0
    for prompt in (PROMPT, "Once upon a time"):
        prompt_ids = serving.tokenizer.encode(prompt)
        got = client.completions.create(model=MODEL_2HOSTS, prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == greedy_text(serving, prompt_ids, 12, serving.eight_heads)
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


def test_two_hosts_show_in_the_info_metric(serving, http):
    (info,) = samples(http, "jax_serve:engine_info", model_name=MODEL_2HOSTS)
    assert {k: info.labels[k] for k in ("num_hosts", "tensor_parallel_size", "num_devices", "mesh")} == {
        "num_hosts": "2", "tensor_parallel_size": "4", "num_devices": "4", "mesh": "data=1,model=4"}
    (single,) = samples(http, "jax_serve:engine_info", model_name=MODEL)
    assert single.labels["num_hosts"] == "1"


def test_replicas_over_two_hosts_scale_as_whole_groups(serving, checkpoint_factory):
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


def test_a_killed_worker_restarts_the_whole_group(serving, client, http):
    """SIGKILL one EngineWorker while a stream is open: the stream ends with an OpenAI error event
    and [DONE], /health turns 503, Ray Serve restarts the replica with a fresh pair of workers, and
    requests succeed again. (Last in this file: the app is unhealthy for a while.)"""
    import os
    import signal

    from tests.support.serving_helpers import sse_events

    stream = OpenStream(http, max_tokens=400, model=MODEL_2HOSTS)
    before = engine_worker_processes()
    os.kill(before[0].pid, signal.SIGKILL)
    events = sse_events(stream.lines)  # reads to the end of the stream: it must end, not hang
    assert events[-1] == "[DONE]" and "error" in events[-2]
    assert events[-2]["error"]["type"] == "server_error"
    wait_for(lambda: httpx.get(f"{serving.url}/health").status_code == 503, 30, "/health to report the lost host")
    wait_for(lambda: httpx.get(f"{serving.url}/health").status_code == 200, 180, "the replica to come back")
    after = engine_worker_processes()
    assert len(after) == 2 and not {p.pid for p in after} & {p.pid for p in before}
    got = client.completions.create(model=MODEL_2HOSTS, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == greedy_text(serving, serving.tokenizer.encode(PROMPT), 12, serving.eight_heads)

