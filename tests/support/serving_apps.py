"""The Ray Serve apps of the serving tests (tests/integration/serving), one per concern, each under
its own route prefix in one Ray instance, so that a model that breaks fails only its concern's tests:

- `text`: the tiny Llama on one device (`MODEL`, compared with transformers), a slow fake engine
  whose requests hold the replica's slots (`MODEL_SLOW`: 429, batching) and two fake replicas behind
  the prefix-affinity router (`MODEL_PAIR`). Small bounds (8 ongoing requests per replica, 8 queued)
  so that the 429 path can be reached. (Ray Serve counts a request as queued until it is assigned to
  a replica, so a burst can be turned away even when slots are free: the queue bound must exceed the
  largest burst a test sends.)
- `multidevice`: the same checkpoint split over two devices (`MODEL_TP2`, read from an S3 bucket:
  moto's server, with a LoRA adapter and n-gram speculation), a Llama with 8 query heads on a
  replica over two host processes (`MODEL_2HOSTS`, downloaded from a Hugging Face Hub repo:
  tests/support/hub_server.py, with a draft model), and a Qwen3-MoE with its experts split over
  two devices (`MODEL_MOE`).
- `media`: the default app's embedding model, a Whisper, a LLaVA and a cross-encoder checkpoint.
- `failure`: a fake engine that fails or hangs on command (`MODEL_FAULTY`).

Every app has an API key, so every /v1 call authenticates.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

API_KEY = "test-key"
MODEL = "tiny-llama"
MODEL_SLOW = "slow-fake"
"""A replica whose engine is tests/support/fake_engine.py's SlowFakeEngine (20 ms a step): requests that
hold its slots for as long as a test needs, whatever the speed of the machine (the 429 test)."""
MODEL_PAIR = "pair-fake"
"""Two replicas of fake_engine.FakeEngine behind the prefix-affinity router."""
MODEL_TP2 = "tiny-llama-tp2"
"""The checkpoint of MODEL, copied from `S3_URI`, on a replica that splits it over 2 host devices
(tensor_parallel_size 2)."""
ADAPTER_TP2 = "tp2-lora"
"""A LoRA adapter over MODEL_TP2 (listed in its lora_modules)."""
S3_URI = "s3://models/team/tiny-llama"
MODEL_2HOSTS = "tiny-llama-2hosts"
"""A Llama with 8 query / 2 KV heads, downloaded from the Hub repo `HUB_REPO`, on a replica over two
host processes (num_hosts 2): the leader schedules, two EngineWorkers with 2 host CPU devices each
hold it split over 4 (gloo collectives)."""
HUB_REPO = "test-org/tiny-llama-8heads"
MODEL_MOE = "tiny-qwen3-moe"
"""tiny_models' qwen3_moe checkpoint (8 experts) over 2 host devices, 4 experts whole on each (the
planner's choice: an expert's MLP of 64 split in two would be 32 lanes)."""
EIGHT_HEADS = dict(hidden_size=128, num_heads=8, num_kv_heads=2, intermediate_size=256)
EMBEDDER = "all-minilm-l6-v2"
"""The default app's embedding model, as deploy/config.yaml configures it."""
MODEL_WHISPER = "tiny-whisper"
"""tiny_models.make_whisper_checkpoint: /v1/audio/*."""
MODEL_LLAVA = "tiny-llava"
"""tiny_models.make_llava_checkpoint: chat with image_url parts."""
MODEL_RERANKER = "tiny-reranker"
"""score_models.make_cross_encoder (BERT): /v1/rerank and /v1/score."""
MODEL_FAULTY = "faulty-fake"
"""A replica whose engine (fake_engine.FaultyFakeEngine) fails or hangs when a test asks it to, with
a 2 s step watchdog, health checks every 1 s that fail after 5 s, 5 s to shut down, and streams the
ingress ends after 3 s of silence (keepalives every 0.5 s)."""
CONCERNS = ("text", "multidevice", "media", "failure")
"""The apps, each deployed under /<concern> as the Serve application <concern>."""

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
"""What the tests send when the words do not matter."""
MAX_MODEL_LEN = 512
MAX_ONGOING = 8
MAX_QUEUED = 8
REPO = Path(__file__).parents[2]
FAKES = "tests.support.fake_engine"
"""The fake engines' module (`engine_cls` FAKES:Class; the replicas find it with the repository on PYTHONPATH)."""
DEFAULT_APP = REPO / "deploy" / "config.yaml"
ENGINE = {"max_num_seqs": 8, "max_model_len": MAX_MODEL_LEN, "max_num_batched_tokens": 256, "prefill_chunk": 64}
ON_PYTHONPATH = {"env_vars": {"PYTHONPATH": str(REPO)}}
TWO_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


@dataclass(frozen=True)
class Sources:
    """Where the apps' models come from: local checkpoints, and the Hub and S3 servers' settings."""

    checkpoint: Path
    moe: Path
    whisper: Optional[Path]
    llava: Optional[Path]
    reranker: Optional[Path]
    """The media app's checkpoints (None when it is not deployed)."""
    adapters: Path
    """A folder with the LoRA adapter `every` (ADAPTER_TP2); tests add their own beside it."""
    hub_env: dict
    s3_env: dict
    cache_dir: Path


def app_args(concern: str, sources: Sources) -> dict:
    """serve_app.build_app's arguments for the app of `concern`."""
    models = {"text": text_models, "multidevice": multidevice_models, "media": media_models,
              "failure": failure_models}[concern](sources)
    return {"api_key": API_KEY, "models": models}


def text_models(sources: Sources) -> list[dict]:
    checkpoint = str(sources.checkpoint)
    bounds = {"max_ongoing_requests": MAX_ONGOING, "max_queued_requests": MAX_QUEUED, "stream_batch_ms": 5}
    return [
        {"model": checkpoint, "model_id": MODEL, **ENGINE, **bounds},
        {"model": checkpoint, "model_id": MODEL_SLOW, **ENGINE, "engine_cls": f"{FAKES}:SlowFakeEngine",
         **ON_PYTHONPATH, **bounds},
        {"model": checkpoint, "model_id": MODEL_PAIR, **ENGINE, "engine_cls": f"{FAKES}:FakeEngine",
         **ON_PYTHONPATH, "num_replicas": 2, "num_cpus": 0.1},
    ]


def multidevice_models(sources: Sources) -> list[dict]:
    tp2 = {"tensor_parallel_size": 2, "warmup": False, "stream_batch_ms": 5}
    from_s3 = {"env_vars": {**TWO_DEVICES, **sources.s3_env}, "cache_dir": str(sources.cache_dir)}
    lora = {"lora_modules": {ADAPTER_TP2: str(sources.adapters / "every")}, "max_lora_rank": 8}
    two_hosts = {**tp2, "num_hosts": 2, "tensor_parallel_size": 4, "num_cpus": 0.4, "health_check_period_s": 1,
                 "env_vars": {**TWO_DEVICES, **sources.hub_env}}
    return [
        {"model": S3_URI, "model_id": MODEL_TP2, **ENGINE, **tp2, **from_s3, **lora,
         "speculative": {"method": "ngram", "num_tokens": 3, "prompt_lookup_min": 1}},
        {"model": HUB_REPO, "model_id": MODEL_2HOSTS, **ENGINE, **two_hosts,
         "speculative": {"method": "draft_model", "model": str(sources.checkpoint), "num_tokens": 3}},
        {"model": str(sources.moe), "model_id": MODEL_MOE, **ENGINE, **tp2, "env_vars": TWO_DEVICES, "num_cpus": 0.1},
    ]


def media_models(sources: Sources) -> list[dict]:
    embedder = yaml.safe_load(DEFAULT_APP.read_text())["applications"][0]["args"]["models"][1]
    return [
        {**embedder, "warmup": False, "num_cpus": 0.1},  # compiled on first use
        {"model": str(sources.whisper), "model_id": MODEL_WHISPER, "max_num_seqs": 4, "num_cpus": 0.1,
         "transcription_fallback": None},  # greedy windows, as the reference decodes
        {"model": str(sources.llava), "model_id": MODEL_LLAVA, **ENGINE, "num_cpus": 0.1, "warmup": False,
         "cache_dir": str(sources.cache_dir)},
        {"model": str(sources.reranker), "model_id": MODEL_RERANKER, "max_num_seqs": 8, "num_cpus": 0.1,
         "warmup": False},  # task: auto reads its BertForSequenceClassification: score
    ]


def failure_models(sources: Sources) -> list[dict]:
    return [
        {"model": str(sources.checkpoint), "model_id": MODEL_FAULTY, **ENGINE,
         "engine_cls": f"{FAKES}:FaultyFakeEngine", **ON_PYTHONPATH, "step_timeout_s": 2,
         "health_check_period_s": 1, "health_check_timeout_s": 5, "graceful_shutdown_timeout_s": 5,
         "num_cpus": 0.1, "stream_batch_ms": 5, "stream_keepalive_s": 0.5, "stream_silence_timeout_s": 3},
    ]
