"""Application configuration, from `serve run` builder args or a Serve YAML file's `args`.

Flat args configure one model (`serve run serve_app:build_app model=/path max_num_seqs=8`); a
`models:` list serves several, each at its own model-server deployment behind one ingress. Values
may arrive as strings (command-line args); pydantic converts them. Invariant: a config that
validates here builds an `EngineConfig` on every replica (engine fields are checked up front).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    TypeAdapter,
    field_validator,
    model_validator,
)

from engine.config import EngineConfig, ModelSource, names_repo
from engine.generate.request import MAX_TOP_LOGPROBS
from engine.transcribe.decoding import Fallback
from serve_app.sampling_defaults import SamplingDefaultsSetting, parse_setting
from serve_app.task_detection import detect_task
from serve_app.tasks import DEFAULT_TASK, EMBED, GENERATE, TASK_NAMES, TASKS

MOVED_ENGINES = {
    "engine.llm_engine:LLMEngine": "engine.generate.engine:LLMEngine",
    "engine.embedding_engine:EmbeddingEngine": "engine.embed.engine:EmbeddingEngine",
    "engine.speech_engine:SpeechEngine": "engine.transcribe.engine:SpeechEngine",
}
"""The engines' import paths before the layout by task (2026-12), and where they are now: a config
written before names the new path in its error instead of failing to import on the replica."""

ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig)) - {"model", "source"}


def _json_if_str(value: Any) -> Any:
    """Dict-valued args may come from the command line as JSON strings."""
    return json.loads(value) if isinstance(value, str) else value


class ModelConfig(BaseModel):
    """One served model: its source, its engine sizes, and how its replicas are placed and bounded."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), use_attribute_docstrings=True)

    model: str
    """A local Hugging Face checkpoint directory, a local .gguf file, a builtin alias such as
    `smollm2-135m-instruct`, an `s3://` or `gs://` prefix holding a checkpoint, a Hugging Face Hub
    repo id such as `Qwen/Qwen3-0.6B`, or (with `levanter_model`) a checkpoint levanter wrote, local
    or in a bucket (see engine.formats.model_sources)."""
    revision: Optional[str] = None
    """For a Hub repo id: the branch, tag or commit to serve (default: main)."""
    levanter_model: Optional[dict[str, Any] | str] = None
    """For a levanter checkpoint: the `model:` section of the training config that wrote it (e.g.
    {type: llama, hidden_dim: 2048, ...}), inline or as the path of that YAML file."""
    tokenizer: Optional[str] = None
    """For a levanter checkpoint: its tokenizer, a local checkpoint directory or a Hub repo id."""
    model_id: Optional[str] = None
    """The name clients send as `model`. Default: the repo id, else the directory name (a .gguf
    file's stem, a URI's last part), or the alias."""
    cache_dir: Optional[str] = None
    """Where converted/downloaded models are kept on each replica's host (default: the engine's).
    Hub downloads go to the Hugging Face cache (HF_HUB_CACHE)."""
    task: Literal[("auto", *TASK_NAMES)] = "auto"
    """generate: a text model (/v1/completions, /v1/chat/completions); embed: a sentence encoder
    (/v1/embeddings); score: a cross-encoder or a Qwen3-Reranker (/v1/rerank, /v1/score);
    transcribe: a Whisper model (/v1/audio/transcriptions, /v1/audio/translations). auto: score for
    a `*ForSequenceClassification` checkpoint; embed for a checkpoint in the sentence-transformers
    layout (modules.json) or of a BERT / XLM-RoBERTa model_type, and for embedding aliases;
    transcribe for model_type whisper; generate otherwise (a Qwen3-Reranker needs `task: score`). A
    Hub repo id is read from the Hub (its config.json and file list) on the machine that builds the
    app, else from that machine's Hugging Face cache. Set it where the checkpoint is not readable
    from there."""
    engine_cls: Optional[str] = None
    """Import path `module:Class` of the engine, constructed as `cls(EngineConfig)`; imported
    lazily on the model-server replica (the serving layer never imports jax). None: the task's
    (serve_app.tasks: engine.generate.engine:LLMEngine, engine.embed.engine:EmbeddingEngine,
    engine.transcribe.engine:SpeechEngine)."""
    max_image_pixels: int = Field(40_000_000, ge=1)
    """A vision-language model: the most pixels an image may have (checked from its header, before
    it is decoded; a 400 beyond)."""
    image_url_hosts: list[str] = []
    """A vision-language model: the hosts whose http(s) image URLs a replica fetches (exact names,
    e.g. ["images.example.com"]); redirects are not followed. Empty: images come as data: URIs only."""
    max_image_bytes: int = Field(20 * 1024 * 1024, ge=1)
    """The largest image a replica fetches from an allowed host."""
    image_fetch_timeout_s: float = Field(10.0, gt=0)
    """How long a replica waits for an allowed host's image."""
    max_audio_seconds: float = Field(3600.0, gt=0)
    """transcribe: the longest audio one request may send (a 400 beyond it, found while decoding
    the file, which stops there)."""
    transcription_fallback: Optional[Fallback] = Fallback()
    """transcribe: when a 30-second window is decoded again at a higher temperature (repetitive or
    unlikely text) or dropped as silence, as OpenAI's Whisper does: `temperature_increment` (0.2),
    `compression_ratio_threshold` (1.35, on token ids), `logprob_threshold` (-1.0),
    `no_speech_threshold` (0.6); a null threshold is not checked. null: every window is decoded
    once at the request's temperature (repeatable output at temperature 0)."""
    tool_call_parser: Optional[Literal["hermes", "llama3_json", "harmony"]] = None
    """How tool calls are read from the model's text under `tool_choice: auto`: hermes
    (`<tool_call>{...}</tool_call>`: Hermes, Qwen2.5, Qwen3), llama3_json (`{"name": ...,
    "parameters": ...}`: Llama 3.1 / 3.2) or harmony (gpt-oss's messages; one reader makes the
    thinking, answer and calls of every chat). None: from the chat template (harmony for gpt-oss's,
    llama3_json for Llama 3's, else hermes)."""
    reasoning_parser: Optional[Literal["qwen3", "deepseek_r1", "harmony", "none"]] = None
    """How a reasoning model's thinking is read from its chat answers into `reasoning_content`:
    qwen3 / deepseek_r1 (both `<think> ... </think>`; whether the prompt opened the block is read
    from the rendered prompt), harmony (gpt-oss's analysis channel) or none (thinking stays in
    `content`). None: from the chat template (harmony for gpt-oss's, qwen3 where it closes a
    `<think>` block)."""
    sampling_defaults: SamplingDefaultsSetting = "auto"
    """generate: the sampling values of requests that leave them unset. auto: the checkpoint's
    generation_config.json (its temperature, top_p, top_k, min_p and repetition_penalty; vLLM's
    `--generation-config auto`); none: OpenAI's (temperature 1, top_p 1, no top_k, min_p or
    repetition penalty); a mapping such as {temperature: 0.7, top_k: 20}: those values over the
    checkpoint's. /v1/models lists the values in effect."""
    embedding_cache_size: int = Field(0, ge=0)
    """embed: the embeddings one replica keeps, by their input's token ids, least recently used
    dropped first; a repeated input is answered from it without running the model (hits and misses
    in /metrics). 0 (the default): no cache, every input runs the model."""
    lora_modules: dict[str, str] = {}
    """LoRA adapters served over this model, by the name clients send as `model` (vLLM's
    --lora-modules): local directories of PEFT adapters (adapter_config.json and
    adapter_model.safetensors) readable on the replicas' hosts. More can be added at run time with
    POST /v1/load_lora_adapter. The engine holds `max_loras` of them on the devices at once (set
    to min(4, the number listed) when they are listed and it is not set)."""
    max_cpu_loras: int = Field(8, ge=1)
    """LoRA adapters one replica keeps read in host memory; the least recently used goes when
    another is needed (through Ray Serve's model multiplexing, which sends an adapter's requests
    to the replicas that hold it)."""
    engine: dict[str, Any] = {}
    """EngineConfig fields other than `model` (dtype, attention_backend, tensor_parallel_size,
    page_size, num_pages, max_num_seqs, max_num_batched_tokens, prefill_chunk, max_model_len,
    enable_prefix_caching, async_scheduling, warmup, seed, ...).
    They may also be given flat, next to `model`."""

    num_replicas: int = Field(1, ge=1)
    """Model-server replicas (ignored when `autoscaling_config` is set)."""
    autoscaling_config: Optional[dict[str, Any]] = None
    """Ray Serve autoscaling (min_replicas, max_replicas, target_ongoing_requests, ...)."""
    num_cpus: float = Field(0.5, ge=0)
    """Logical CPUs reserved per model-server replica (a scheduling hint; keep it small on a laptop)."""
    resources: dict[str, float] = {}
    """Other per-replica resources, e.g. {"TPU": 4} to pin a replica to a TPU host's chips."""
    accelerator_type: Optional[str] = None
    """Ray accelerator type to schedule on, e.g. "TPU-V5LITEPOD" or "TPU-V4"."""
    placement_group_bundles: Optional[list[dict[str, float]]] = None
    """A replica's placement group: the replica's own actor (the leader) takes the first bundle.
    With `num_hosts` > 1 and no bundles given: the leader's ({"CPU": num_cpus}), then one per host
    for its EngineWorker ({"CPU": num_cpus, **resources})."""
    placement_group_strategy: str = "STRICT_PACK"
    """How `placement_group_bundles` are placed (STRICT_SPREAD: one bundle per host)."""
    env_vars: dict[str, str] = {}
    """Environment of the model-server replicas (e.g. JAX_PLATFORMS, HF_HUB_OFFLINE)."""

    request_router: Literal["prefix_affinity", "power_of_two"] = "prefix_affinity"
    """How the ingress picks a replica for a request (serve_app/http/routing.py): prefix_affinity sends
    it to the replica that was given the longest prefix of its prompt before (its KV pages are
    likely still cached there) unless that replica's queue is 4 requests longer than the shortest,
    else as power_of_two does: the shorter queue of two random replicas (Ray Serve's default)."""
    max_ongoing_requests: int = Field(64, ge=1)
    """Requests one replica serves at once (in its engine, running or waiting for a batch slot)."""
    max_queued_requests: int = Field(256, ge=-1)
    """Requests an ingress replica queues for this model while every server replica is at
    `max_ongoing_requests`; beyond that clients get 429 with Retry-After. -1: unbounded."""
    retry_after_s: float = Field(1.0, gt=0)
    """The Retry-After sent with a 429."""
    stream_batch_ms: float = Field(50.0, ge=0)
    """Least time between two stream chunks of one request (the first, and the one that finishes a
    choice, go at once): tokens made in between travel over the Ray hops as one chunk. Every chunk
    costs CPU in the replica, the ingress and the proxy, so larger values leave more CPU to the
    engine at high concurrency; smaller ones stream smoother. 0 sends every step's tokens."""
    stream_chunks_per_s: float = Field(50.0, gt=0)
    """Stream chunks per second one replica sends at most, shared by its open streams: with S
    streams, each waits max(stream_batch_ms, S / stream_chunks_per_s) between chunks. This bounds
    the serving layer's CPU under load, however many streams are open (docs/benchmarks.md); raise
    it where cores are spare."""
    engine_niceness: Optional[int] = Field(0, ge=-20, le=19)
    """Niceness of the engine's threads (the loop, XLA's thread pools). Ray starts its workers at 15
    so that its daemons win the CPU; on a CPU-only host the engine is the work, and at 15 every
    daemon wake-up stalls a decode step. Lowering it needs CAP_SYS_NICE (root in most containers);
    without it a warning suggests `RAY_worker_niceness=0`. None keeps Ray's. Where several models'
    replicas share a small host, a higher value for the secondary ones gives the main one the CPU
    first, their compiles at start included (docs/benchmarks.md, "what a second replica's
    background compiles cost")."""
    health_check_period_s: float = Field(10.0, gt=0)
    """How often Ray Serve probes a replica; a replica whose engine died is restarted."""
    health_check_timeout_s: float = Field(30.0, gt=0)
    """How long Ray Serve waits for a probe's answer; a replica that misses three in a row (frozen,
    or its host lost) is replaced, so a stuck replica goes after ~3 x (period + timeout)."""
    stream_keepalive_s: float = Field(5.0, gt=0)
    """A streamed request sends the ingress an empty batch (not forwarded to the client) after this
    long without output (queued, or in a long prefill): a sign of life for the silence timeout."""
    stream_silence_timeout_s: float = Field(60.0, gt=0)
    """The ingress ends a stream whose replica sent nothing, not even a keepalive, for this long (a
    frozen or lost replica) with a 503 error event and [DONE]. Must exceed stream_keepalive_s."""
    max_constructor_retry_count: Optional[int] = Field(None, ge=1)
    """Starts of a replica whose constructor fails (a bad checkpoint, a config error) before Serve
    gives up and the model is reported failed; Serve tries at most 3 per replica whatever is set.
    None: Serve's default. 1 where a failed start is not worth repeating (a model that takes minutes
    to load)."""
    graceful_shutdown_timeout_s: float = Field(30.0, ge=0)
    """On shutdown or scale-down, a replica gets no new requests and its running ones have this long
    to finish; then what is left ends with an error event and the replica stops."""

    _dict_args = field_validator("engine", "autoscaling_config", "resources", "env_vars", "lora_modules",
                                 mode="before")(
        classmethod(lambda cls, v: _json_if_str(v))
    )

    _sampling_defaults = field_validator("sampling_defaults", mode="before")(
        classmethod(lambda cls, v: parse_setting(v))
    )

    @model_validator(mode="before")
    @classmethod
    def _gather_engine_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        flat = {k: v for k, v in data.items() if k in ENGINE_FIELDS}
        rest = {k: v for k, v in data.items() if k not in ENGINE_FIELDS}
        return {**rest, "engine": {**_json_if_str(rest.get("engine", {})), **flat}}

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        unknown = set(self.engine) - ENGINE_FIELDS
        if unknown:
            raise ValueError(f"unknown engine fields {sorted(unknown)}; known: {sorted(ENGINE_FIELDS)}")
        if self.lora_modules and not self.engine.get("max_loras"):
            self.engine["max_loras"] = min(4, len(self.lora_modules))
        self.engine = dataclasses.asdict(self.engine_config(self.model))  # validated and converted
        del self.engine["model"], self.engine["source"]
        if (self.levanter_model is None) != (self.tokenizer is None):
            raise ValueError("a levanter checkpoint needs both levanter_model (its training config's model "
                             "section) and tokenizer; other models carry their own config and tokenizer")
        if self.model_id is None:
            self.model_id = default_model_id(self.model)
        if self.task == "auto":
            self.task = detect_task(self.model, self.revision) if self.levanter_model is None else DEFAULT_TASK
        if self.engine_cls is None:
            self.engine_cls = TASKS[self.task].engine
        if self.lora_modules and not TASKS[self.task].lora:
            raise ValueError(f"lora_modules adapt a text generation model; {self.model_id!r} is a {self.task} model")
        self._check_task_fields()
        if ":" not in self.engine_cls:
            raise ValueError(f"engine_cls must look like 'module:Class', got {self.engine_cls!r}")
        if self.engine_cls in MOVED_ENGINES:
            raise ValueError(f"engine_cls {self.engine_cls!r} has moved: set engine_cls to "
                             f"{MOVED_ENGINES[self.engine_cls]!r} (or leave it out for the task's default)")
        parsers = {self.tool_call_parser, self.reasoning_parser}
        if "harmony" in parsers and parsers - {"harmony", None, "none"}:
            raise ValueError(f"harmony is one format for a model's thinking and its tool calls; set tool_call_parser "
                             f"({self.tool_call_parser}) and reasoning_parser ({self.reasoning_parser}) to harmony")
        if self.stream_silence_timeout_s <= self.stream_keepalive_s:
            raise ValueError(f"stream_silence_timeout_s ({self.stream_silence_timeout_s:g}) must exceed "
                             f"stream_keepalive_s ({self.stream_keepalive_s:g}); raise it")
        return self

    def _check_task_fields(self) -> None:
        """Fields that only one task reads are refused on another's model."""
        if self.sampling_defaults not in ("auto", "none") and self.task != GENERATE:
            raise ValueError(f"sampling_defaults applies to text generation models; {self.model_id!r} is "
                             f"{TASKS[self.task].what}: leave it out")
        if self.embedding_cache_size and self.task != EMBED:
            raise ValueError(f"embedding_cache_size applies to embedding models; {self.model_id!r} is "
                             f"{TASKS[self.task].what}: leave it out")

    def engine_config(self, model_dir: str | Path) -> EngineConfig:
        """The engine's config for a resolved local checkpoint directory."""
        fields = {**self.engine, "model": str(model_dir), "source": self.source}
        return TypeAdapter(EngineConfig).validate_python(fields)

    @property
    def source(self) -> ModelSource:
        """Where the model comes from (engine.formats.model_sources resolves it on each host)."""
        return ModelSource(self.model, self.revision, self.tokenizer, self.levanter_model, self.cache_dir)

    @property
    def deployment_name(self) -> str:
        """The model server's deployment: its task's prefix and the model id (e.g. TextServer-my-model)."""
        return f"{TASKS[self.task].deployment}-" + re.sub(r"[^A-Za-z0-9_.-]", "-", self.model_id)


def default_model_id(spec: str) -> str:
    """A Hub repo id itself, a checkpoint directory's name (a URI's last part), a .gguf file's stem,
    or the alias itself."""
    if names_repo(spec):
        return spec
    path = Path(spec.rstrip("/"))
    return path.stem if path.suffix.lower() == ".gguf" else path.name


MIB = 1 << 20


class RequestLimits(BaseModel):
    """What one HTTP request may ask for, checked by the ingress before any model server sees it.
    A body over the size limit is a 413; any other limit exceeded is a 400 naming the field.
    The defaults admit every request an OpenAI client or lm-eval sends in practice and bound what
    one hostile request costs: each choice (prompt x n) is an engine request, each stop string and
    stop token id is checked on every generated token. Each field may also be given flat."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_request_body_bytes: int = Field(32 * MIB, ge=1)
    """Largest request body, in bytes (a 413 beyond it, read no further). The default holds a batch
    of long-context token-id prompts many times over, and bounds the memory one request takes in
    the proxy, the ingress and the tokenizer. vLLM sets none."""
    max_prompts_per_request: int = Field(256, ge=1)
    """Prompts in one /v1/completions request (a list `prompt`)."""
    max_n: int = Field(128, ge=1)
    """Choices per prompt (`n`); OpenAI's own limit is 128."""
    max_choices_per_request: int = Field(256, ge=1)
    """Prompts x n: the engine requests one HTTP request becomes. Beyond a few engine batches
    (`max_num_seqs`) they only queue behind each other, and hold up everyone else's requests."""
    max_stop_strings: int = Field(64, ge=0)
    """Stop strings per request (OpenAI accepts 4; vLLM any number). Each is searched for in the
    text of every generated token."""
    max_stop_string_chars: int = Field(1024, ge=1)
    """Characters per stop string: the text held back while it might still match costs up to
    this squared per token."""
    max_stop_token_ids: int = Field(64, ge=0)
    """Entries of `stop_token_ids` (checked on every generated token)."""
    max_logit_bias_entries: int = Field(300, ge=0)
    """Entries of `logit_bias` (OpenAI's limit is 300)."""
    max_images_per_request: int = Field(8, ge=0)
    """Image parts in one chat request (a vision-language model's input; each takes its model's
    tokens per image of the context)."""
    max_logprobs: int = Field(MAX_TOP_LOGPROBS, ge=0, le=MAX_TOP_LOGPROBS)
    """Largest `logprobs` (completions) and `top_logprobs` (chat); the engine computes at most
    20 alternatives per token (a compiled shape), as OpenAI's API allows."""


def _list_if_str(value: Any) -> Any:
    """List-valued args from the command line: a JSON list, or comma-separated values."""
    if not isinstance(value, str):
        return value
    return json.loads(value) if value.lstrip().startswith("[") else [v.strip() for v in value.split(",") if v.strip()]


class CorsConfig(BaseModel):
    """CORS for browser clients, answered by the ingress (Starlette's CORSMiddleware). Off while
    `allowed_origins` is empty. Credentials (cookies) are never allowed: clients authenticate with
    the bearer key. `Retry-After` is exposed, so a browser can honour a 429. Fields may be given flat."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    allowed_origins: list[str] = []
    """Origins allowed to call the API from a browser, e.g. ["https://app.example.com"]; ["*"] for
    any. Empty (the default): no CORS headers, so browsers refuse cross-origin calls."""
    allowed_methods: list[str] = ["GET", "POST"]
    """HTTP methods allowed cross-origin (["*"] for any)."""
    allowed_headers: list[str] = ["*"]
    """Request headers allowed cross-origin. Any by default: the OpenAI SDKs send their own
    (x-stainless-*) next to Authorization and Content-Type."""

    _lists = field_validator("allowed_origins", "allowed_methods", "allowed_headers", mode="before")(
        classmethod(lambda cls, v: _list_if_str(v))
    )


class TracingConfig(BaseModel):
    """OpenTelemetry traces of requests (serve_app/tracing.py; needs `pip install 'jax-serve[otel]'`):
    a span per request in the ingress, the model-server replica and the engine (queued, prefill,
    decode), continuing the client's W3C `traceparent`. Fields may be given flat."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    otlp_traces_endpoint: Optional[str] = None
    """Where spans go, over OTLP/HTTP (e.g. http://otel-collector:4318/v1/traces). None: no traces."""


INGRESS_SECTIONS = {"limits": RequestLimits, "cors": CorsConfig, "tracing": TracingConfig}
"""AppConfig fields whose own fields may also be given flat, next to the app's."""


class AppConfig(BaseModel):
    """The whole application: the models and the ingress in front of them."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    models: list[ModelConfig] = Field(min_length=1)
    """The served models, each behind its own model-server deployment."""
    api_key: Optional[SecretStr] = None
    """When set, every /v1 route needs `Authorization: Bearer <api_key>` (/health and /metrics
    stay open for probes and scrapers)."""
    ingress_replicas: int = Field(1, ge=1)
    """Ingress replicas (CPU only; each bounds its own queue of `max_queued_requests`)."""
    ingress_num_cpus: float = Field(0.1, ge=0)
    """Logical CPUs reserved per ingress replica."""
    ingress_max_ongoing_requests: int = Field(1024, ge=1)
    """Concurrent HTTP requests per ingress replica (Ray Serve's default of 5 would serialize
    streams)."""
    limits: RequestLimits = Field(default_factory=RequestLimits)
    """Per-request bounds: body size, prompts, n, choices, stop strings, stop token ids,
    logit_bias, logprobs (see RequestLimits; its fields may be given flat)."""
    cors: CorsConfig = Field(default_factory=CorsConfig)
    """CORS for browser clients, off by default (see CorsConfig; its fields may be given flat)."""
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    """OpenTelemetry traces, off by default (see TracingConfig; its fields may be given flat)."""

    @model_validator(mode="before")
    @classmethod
    def _gather_ingress_fields(cls, data: Any) -> Any:
        """Flat RequestLimits / CorsConfig fields go into `limits` / `cors` (which may also come
        as JSON strings from the command line)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for section, section_cls in INGRESS_SECTIONS.items():
            given = _json_if_str(data.get(section, {}))
            given = given.model_dump() if isinstance(given, BaseModel) else given
            flat = {k: data.pop(k) for k in list(data) if k in section_cls.model_fields}
            data[section] = {**given, **flat}
        return data

    @model_validator(mode="after")
    def _unique_ids(self) -> "AppConfig":
        ids = [m.model_id for m in self.models]
        if len(set(ids)) != len(ids):
            raise ValueError(f"model ids must be unique, got {ids}; set model_id for each model")
        names = [name for m in self.models for name in m.lora_modules]
        taken = sorted(set(ids) & set(names)) or sorted({n for n in names if names.count(n) > 1})
        if taken:
            raise ValueError(f"LoRA adapter names must be unique and differ from the model ids; {taken} "
                             "is used twice: rename it in lora_modules")
        return self

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> "AppConfig":
        """Builder args: either `models: [...]` plus app fields, or one model's fields given flat
        next to the app fields."""
        if "models" in args:
            return cls.model_validate({**args, "models": _json_if_str(args["models"])})
        app_keys = set(cls.model_fields).union(*(c.model_fields for c in INGRESS_SECTIONS.values())) - {"models"}
        app = {k: v for k, v in args.items() if k in app_keys}
        model = {k: v for k, v in args.items() if k not in app_keys}
        return cls.model_validate({**app, "models": [model]})
