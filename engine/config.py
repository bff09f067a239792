"""Engine configuration: frozen, documented dataclasses. Pure Python (no jax import, no I/O)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Literal, Optional, get_args

DType = Literal["float32", "bfloat16"]
AttentionBackendName = Literal["auto", "cpu", "xla", "tpu"]
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackendName)
"""The attention backends (engine/backends) by name; `auto` lets engine.backends.select pick."""
CpuMatmul = Literal["auto", "kernel", "xla", "xla_f32"]
CPU_MATMULS: tuple[str, ...] = get_args(CpuMatmul)

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def is_repo_id(spec: str) -> bool:
    """Whether `spec` has the shape of a Hub repo id (`org/name`, not a .gguf file's path); the caller
    checks local paths first."""
    return bool(_REPO_ID.match(spec)) and ".." not in spec and "--" not in spec and not spec.lower().endswith(".gguf")


def names_repo(spec: str) -> bool:
    """Whether `spec` means a Hub repo here: a repo id's shape, and no local path of that name."""
    return is_repo_id(spec) and not Path(spec).expanduser().exists()


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model comes from, as configured (serve_app.config.ModelConfig's fields of these names);
    engine.formats.model_sources turns it into a local checkpoint directory."""

    model: str
    """A local checkpoint directory, a .gguf file, a builtin alias, an `s3://` / `gs://` prefix, a
    levanter checkpoint (with `levanter_model`), or a Hub repo id `org/name` (see
    engine.formats.model_sources)."""
    revision: Optional[str] = None
    """For a Hub repo id: the branch, tag or commit (default: main)."""
    tokenizer: Optional[str] = None
    """For a levanter checkpoint: the tokenizer (a local checkpoint directory or a Hub repo id)."""
    levanter_model: Optional[dict[str, Any] | str] = None
    """For a levanter checkpoint: the `model:` section of the training config that wrote it, or the
    path of that YAML file."""
    cache_dir: Optional[str] = None
    """Where converted and copied models are kept (default: engine.formats.model_sources.default_cache_dir())."""

    def __hash__(self) -> int:  # the inline levanter config is a dict: hash its JSON
        model = json.dumps(self.levanter_model, sort_keys=True)
        return hash((self.model, self.revision, self.tokenizer, model, self.cache_dir))

    def describe(self) -> str:
        """The source in one line, e.g. "Qwen/Qwen3-0.6B@main" or "s3://bucket/ckpt"."""
        if self.levanter_model is not None:
            return f"levanter:{self.model}"
        if names_repo(self.model):
            return f"{self.model}@{self.revision or 'main'}"
        return self.model


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/generate/speculation.py): a decoding row carries up to `num_tokens`
    guessed next tokens, the step computes them all, and the guesses the model itself would have
    sampled are kept. Greedy and seeded output are the tokens decoding one at a time gives."""

    method: Literal["ngram", "draft_model"] = "ngram"
    """ngram: prompt lookup. The sequence's last n tokens (n from `prompt_lookup_max` down to
    `prompt_lookup_min`) are looked up earlier in its prompt and output; the tokens that followed
    their latest occurrence are the guesses. Free to make, and right where output repeats its
    input (code edits, summaries, extraction, multi-turn chat).
    draft_model: a smaller model of the same vocabulary (`model`) runs beside the served one over
    the same KV pages and guesses greedily, `num_tokens` decode steps of its own per round; right
    wherever the small model agrees with the large one, repetitive or not."""
    model: Optional[str] = None
    """With draft_model: the draft checkpoint (a local directory, an alias, a Hub repo id or an
    s3:// / gs:// prefix, as a model's `model`); it must share the served model's vocabulary."""
    num_tokens: int = 4
    """Guessed tokens per decoding row at most: a step then emits 1 to num_tokens + 1 tokens per row."""
    prompt_lookup_min: int = 2
    """The shortest suffix looked up."""
    prompt_lookup_max: int = 4
    """The longest suffix looked up (longer matches are tried first)."""
    max_step_tokens: Optional[int] = None
    """Token slots that a step's decoding rows and their guesses take at most (the guesses share
    what the rows' own tokens leave, row by row). A step costs about what one token does only up
    to some size: past it, guesses that fail cost more time than the ones kept save. None: the
    devices' own figure, 8 on CPUs (compute-bound past a handful of rows) and the whole step
    budget on accelerators (a step reads the weights once, whatever its rows)."""

    def __post_init__(self):
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative.method must be 'ngram' or 'draft_model', got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative.model names the draft checkpoint: set it with method draft_model, "
                             f"and only then (method {self.method!r}, model {self.model!r})")
        if self.num_tokens < 1:
            raise ValueError(f"speculative.num_tokens must be at least 1, got {self.num_tokens}")
        if self.max_step_tokens is not None and self.max_step_tokens < 2:
            raise ValueError(f"speculative.max_step_tokens must be at least 2 (or None), got {self.max_step_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes and switches of one engine (one model replica)."""

    model: str
    """Local Hugging Face checkpoint directory (absolute or relative) of a Llama, Qwen2, Qwen3,
    Mistral, Mixtral, OLMo 2, Gemma 2 or Gemma 3 (text) model (LLMEngine), or of a BERT sentence
    encoder (EmbeddingEngine: it reads `dtype`, `max_num_seqs`, `max_num_batched_tokens`,
    `max_model_len`, `warmup`, `compilation_cache_dir`, `step_timeout_s`)."""
    source: Optional[ModelSource] = None
    """Where `model` came from (the serving layer sets it): a host of a multi-host replica that
    lacks the `model` directory fetches it from there into its own cache before it loads."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights and activations. auto: the checkpoint's own, as its config.json declares it
    (float16 served as bfloat16). bfloat16 halves memory; matmuls accumulate in float32. On the cpu
    attention backend, activations stay float32 whatever the weights' dtype."""
    quantization: Optional[Literal["int8"]] = None
    """Weight-only quantization made at load time from the checkpoint's float weights. int8: every
    linear layer's weight, each expert's (a router's stays float) and the token embedding as int8
    with a float32 scale per output channel (engine/layers/quantize.py): about half of bfloat16's
    weight memory and of the bytes a decode step reads. Where the host's CPU is not a replica device
    (TPUs, GPUs), the weights are made on the host and the devices only ever hold the int8 ones.
    Activations, norms and the KV cache keep `dtype`. None: the weights as loaded."""
    kv_cache_dtype: Optional[DType] = None
    """The KV cache's dtype; None: the weights' dtype. bfloat16 halves the cache (twice the
    tokens in the same memory) and the bytes attention reads per cached token; scores and sums
    are float32 either way."""
    page_size: int = 16
    """Tokens per KV page; also the prefix cache's granularity."""
    num_pages: int = 0
    """KV pages in the pool (page 0 is reserved as a scratch page for padding). 0: on an
    accelerator, `kv_cache_memory_fraction` of the memory left after the weights; on a CPU, enough
    for every sequence slot to hold `max_model_len` tokens."""
    kv_cache_memory_fraction: float = 0.9
    """With `num_pages: 0` on an accelerator: the fraction of each device's memory left after
    loading the weights that the KV pool takes (like vLLM's gpu_memory_utilization, but of what
    the weights leave). The rest is headroom for activations and compiled programs."""
    max_num_seqs: int = 32
    """Sequences decoded together at most (the batch size)."""
    max_num_batched_tokens: int = 512
    """Token budget of one step, shared by decodes (one token each) and prompts: a prompt that fits
    the budget beside the running decodes is read in one step, a longer one in budget-sized chunks.
    Also the largest compiled step: a step costs about what its tokens cost, never more than the
    next rung of the bucket ladder (engine.step.buckets)."""
    prefill_chunk: Optional[int] = None
    """Prompt tokens one sequence contributes to one step at most. None: the whole budget. Lower it
    to keep the steps that read long prompts short, so decoding sequences wait less between
    tokens (at the cost of more steps before a long prompt's first token)."""
    max_model_len: Optional[int] = None
    """Prompt + output tokens per sequence. None: the model's max_position_embeddings, capped at 4096."""
    enable_prefix_caching: bool = True
    """Reuse full KV pages across requests that share a prompt prefix."""
    scan_layers: Optional[bool] = None
    """Run the layers as one loop over the stacked layers (True) or unrolled (False). A scanned
    loop compiles one layer, so compile time does not grow with depth; unrolled, every layer is
    compiled on its own. None: the attention backend's choice, scanned wherever that costs no
    speed (engine/models/paged_model.py)."""
    attention_backend: AttentionBackendName = "auto"
    """How attention and the KV cache run (engine/backends): `cpu` the project's x86 kernels
    (AVX2 + FMA; packed bf16 weights, built on first use with the system C++ compiler; one device
    only), `xla` masked attention in plain JAX over blocks of pages (any device, any mesh), `tpu` ragged paged
    attention (JAX's Pallas kernel on TPU v4 and later; levanter's exact, slow reference elsewhere). auto: cpu on
    x86 CPUs, tpu on TPUs, xla elsewhere. A backend that cannot run as asked (no compiler, several
    devices for cpu) gives way to xla with a warning."""
    cpu_matmul: CpuMatmul = "auto"
    """On the cpu backend: which matmul each product runs. auto: per shape (rows of a bucket x
    weight), the fastest of the project's kernel, XLA's dot in the weights' dtype and XLA's dot in
    float32 (the weight widened in the step; timed from 64 rows), timed at warm-up on this machine
    and cached with the compiled buckets (XLA's dot wins many-row products on CPUs with AMX or
    AVX-512; the kernel wins decoding). Each path reads its own layout (the kernel packed panels,
    XLA a plain matrix); a weight whose row counts split between the kernel and XLA holds both (the
    log says how much memory that takes). kernel / xla / xla_f32: that one for every product, one
    layout per weight."""
    num_hosts: int = 1
    """Processes (hosts) the replica spans: 1 runs the model in this process; N > 1 starts one
    `EngineWorker` per host (engine/generate/executor/multihost.py) that together hold the model, split over
    `tensor_parallel_size` devices in all, while this process only schedules."""
    tpu_version: Optional[str] = None
    """With num_hosts > 1 and `tpu_topology`: the TPU generation of the slice (v4, v5e, v5p, v6e)."""
    tpu_topology: Optional[str] = None
    """With num_hosts > 1: place the workers on the hosts of one TPU slice of this topology (e.g.
    2x2x2 for a v4-16: 2 hosts of 4 chips) through Ray's TPU slice placement (the slice head's
    resource, then every host labelled with that slice's name); num_hosts must be its host count.
    None: the workers take the bundles of the replica's placement group."""
    step_timeout_s: float = 600.0
    """A step that has not returned within this many seconds fails the engine: its requests end
    with an error at once and the replica's health check fails (Serve restarts it), so a stuck
    device or host never hangs clients. Keep it well above the slowest step (a first-use compile)."""
    tensor_parallel_size: int = 1
    """Devices the model is split over (a ("data", "model") mesh of 1 x N): attention heads, KV
    heads, MLP and vocabulary on "model"; the KV cache split by KV head (KV heads repeated when
    fewer than N). N must divide the query heads and the MLP size."""
    expert_parallel_size: Optional[int] = None
    """For a mixture of experts over tensor_parallel_size > 1 devices: tensor_parallel_size splits
    the experts over the devices whole (expert parallelism), 1 splits each expert's MLP as a dense
    MLP's. None: whole experts when they divide evenly and an expert's MLP split N ways would be
    narrower than 128 lanes (engine.generate.runner.sharding.plan_experts)."""
    async_scheduling: bool = True
    """Overlap host work with the device: plan and dispatch step N+1 while step N runs, its
    sampled tokens fed to N+1 on the device. The host's share of a step (planning, input arrays,
    dispatch, delivering tokens) then hides behind the computation. Output is identical; a
    sequence that ends on EOS or a stop token computes one extra token, discarded. Steps with
    penalties run one at a time (they need every sampled token on the host)."""
    warmup: bool = True
    """Compile every shape bucket when the engine starts (logged), not on the first request."""
    compilation_cache_dir: Optional[str] = "~/.cache/jax-serve/xla"
    """XLA's persistent compilation cache: a restarted replica loads its compiled buckets instead of
    compiling them again. A URL (gs://bucket/dir) is one cache the hosts of a slice share. None
    disables it."""
    seed: int = 0
    """Seed for requests that bring none (each still gets its own stream of randomness)."""
    max_loras: int = 0
    """LoRA adapters the devices hold at once (engine/layers/lora.py): the rows of one step may each
    run a different one of them over the shared base weights; a request whose adapter is not among
    them waits until a slot frees (least recently used adapters give way). 0: no adapters (the
    step programs carry no LoRA work). Each slot costs rank x (in + out) per adapted projection
    of every layer, in the weights' dtype."""
    max_lora_rank: int = 16
    """The largest rank of an adapter the engine takes (slots are this size; lower ranks are
    zero-padded)."""
    image_slots: int = 8
    """A vision-language model (LLaVA): images whose features the devices hold at once
    (engine/generate/images.py). Running requests hold their images' slots (a request whose images
    find none free waits for them); a released image keeps
    its slot, for a follow-up turn's prefix-cache hit, until another image needs it. Each slot
    costs tokens_per_image x hidden_size values in the weights' dtype (LLaVA-1.5-7B: 576 x 4096)."""
    speculative: Optional[SpeculativeConfig] = None
    """Speculative decoding, e.g. {method: ngram, num_tokens: 4}; None: one token per row and step.
    Steps that carry guesses run one at a time (the next step's rows depend on how many were kept);
    the others still overlap as `async_scheduling` says. Rows of requests with penalties, logit
    bias, min_tokens or a grammar never carry guesses."""

    @property
    def max_drafts(self) -> int:
        """Guessed tokens a decoding row may carry (0 without speculative decoding)."""
        return 0 if self.speculative is None else self.speculative.num_tokens

    @property
    def draft_model(self) -> Optional[str]:
        """The draft checkpoint of speculative decoding by a draft model (None: no draft model)."""
        return None if self.speculative is None else self.speculative.model

    def __post_init__(self):
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1 (or None: the whole budget), got {self.prefill_chunk}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode each step"
            )
        if self.num_pages < 0 or self.num_pages == 1:
            raise ValueError(f"num_pages must be 0 (auto) or at least 2, got {self.num_pages}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be {_one_of(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if self.cpu_matmul not in CPU_MATMULS:
            raise ValueError(f"cpu_matmul must be {_one_of(CPU_MATMULS)}, got {self.cpu_matmul!r}")
        if self.num_hosts < 1:
            raise ValueError(f"num_hosts must be at least 1, got {self.num_hosts}")
        if (self.tpu_topology is None) != (self.tpu_version is None):
            raise ValueError("set both tpu_version and tpu_topology (e.g. v4 and 2x2x2), or neither")
        if self.step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be positive, got {self.step_timeout_s}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be None or 'int8', got {self.quantization!r}")
        if self.image_slots < 1:
            raise ValueError(f"image_slots must be at least 1, got {self.image_slots}")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras must be non-negative and max_lora_rank at least 1, got {self.max_loras} "
                             f"and {self.max_lora_rank}")
        if self.kv_cache_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"kv_cache_dtype must be None, 'float32' or 'bfloat16', got {self.kv_cache_dtype!r}")


def _one_of(names: tuple[str, ...]) -> str:
    """'a', 'b' or 'c'."""
    quoted = [repr(name) for name in names]
    return f"{', '.join(quoted[:-1])} or {quoted[-1]}"
