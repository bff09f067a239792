"""Tiny random Hugging Face checkpoints made on the spot with transformers, for tests and benchmarks.

Each checkpoint is a real directory (config.json, model.safetensors, tokenizer files with a ChatML
chat template) that the engine loads through its real loader, and that transformers loads as the
reference implementation.
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Once upon a time there was a little engine that could.",
    "Pages of keys and values live in a cache; prefixes are shared.",
    "Ünïcödé wörds, emoji 🚀🔥 and 中文字符 test multi-byte characters.",
    "def add(a, b):\n    return a + b\n",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \"",
]


def make_tokenizer(vocab_size: int = 512, pad_vocab: bool = False):
    """A byte-level BPE tokenizer (so any text round-trips) with ChatML special tokens.

    The tiny corpus stops BPE training well short of a large `vocab_size`; `pad_vocab` fills the
    vocabulary up to exactly `vocab_size` ids with filler tokens (`<f123>`) that no text ever
    tokenizes to (no merge builds them) but that decode to their own text, so a model with a big
    vocabulary can generate any id and still be detokenized.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    if pad_vocab:
        tok = _pad_vocab(tok, vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token=None,
        unk_token=None,
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _pad_vocab(tok, vocab_size: int):
    """The BPE tokenizer `tok` with filler tokens appended to its model vocabulary up to `vocab_size`."""
    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    next_id, i = len(vocab), 0
    while next_id < vocab_size:
        name = f"<f{i}>"
        i += 1
        if name not in vocab:
            vocab[name] = next_id
            next_id += 1
    return Tokenizer.from_str(json.dumps(spec))


def make_checkpoint(
    out_dir: str | Path,
    family: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.2,
    dtype: str = "float32",
    seed: int = 0,
    tokenizer_vocab: int = 512,
    pad_tokenizer_vocab: bool = False,
    decoder_sparse_step: int = 1,
    norm_topk_prob: bool = True,
    longrope_from: int = 32,
    num_experts: int = 8,
    experts_per_token: int = 2,
    expert_intermediate_size: int | None = None,
) -> Path:
    """Write a random `family` checkpoint (llama, qwen2, qwen3, mistral, mixtral, olmo2, gemma2,
    gemma3: its text model; qwen3_moe: `num_experts` experts of `expert_intermediate_size` (default
    `intermediate_size` / 2), `experts_per_token` a token, on every `decoder_sparse_step`-th layer,
    dense MLPs on the others; phi3: half of each head rotated, longrope's
    long factors past `longrope_from` tokens; gpt_oss: 4 experts of `intermediate_size` / 2, 2 a token,
    sinks, sliding even layers, YaRN; deepseek_v3: latent attention, a dense first layer, then 8 routed
    experts in 4 groups and a shared one) with a tokenizer.

    `pad_tokenizer_vocab` pads the tokenizer to exactly `tokenizer_vocab` ids (see make_tokenizer).

    A large `initializer_range` makes the random model's next-token distributions peaked, so greedy
    decoding has no near-ties and parity with transformers is exact rather than lucky.
    """
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(tokenizer_vocab, pad_vocab=pad_tokenizer_vocab)
    vocab = vocab_size or len(tokenizer)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        rms_norm_eps=1e-6,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        bos_token_id=None,
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    if family == "llama":
        config = transformers.LlamaConfig(**common, rope_theta=10000.0)
    elif family == "mistral":
        config = transformers.MistralConfig(**common, rope_theta=10000.0, sliding_window=None)
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common, rope_theta=10000.0, use_sliding_window=False)
    elif family == "qwen3":
        config = transformers.Qwen3Config(
            **common, head_dim=hidden_size // num_heads, rope_theta=10000.0, use_sliding_window=False
        )
    elif family == "mixtral":
        config = transformers.MixtralConfig(**common, rope_theta=10000.0, sliding_window=None, num_local_experts=4,
                                            num_experts_per_tok=2)
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common, head_dim=hidden_size // num_heads, rope_theta=10000.0, use_sliding_window=False,
            num_experts=num_experts, num_experts_per_tok=experts_per_token,
            moe_intermediate_size=expert_intermediate_size or intermediate_size // 2, norm_topk_prob=norm_topk_prob,
            decoder_sparse_step=decoder_sparse_step, mlp_only_layers=[])
    elif family == "phi3":  # Phi-4-mini's half-rotated heads; Phi-3-128k's longrope
        rotated = hidden_size // num_heads // 2
        config = transformers.Phi3Config(**common, rope_theta=10000.0, partial_rotary_factor=0.5, sliding_window=None,
                                         original_max_position_embeddings=longrope_from, rope_scaling={
                                             "type": "longrope", "short_factor": [1.0, 1.5, 2.0, 4.0][:rotated // 2],
                                             "long_factor": [2.0, 3.0, 8.0, 16.0][:rotated // 2]})
    elif family == "gpt_oss":  # 4 experts of intermediate_size / 2, 2 a token; even layers slide over 16 tokens;
        # heads twice hidden_size / num_heads wide, as gpt-oss's (64 x 64 heads over 2,880)
        config = transformers.GptOssConfig(
            **{**common, "intermediate_size": intermediate_size // 2}, head_dim=2 * hidden_size // num_heads,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=16, rope_theta=10000.0, swiglu_limit=7.0,
            layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
            rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                          "original_max_position_embeddings": 64})
    elif family == "deepseek_v3":  # latent attention (a 48-wide latent, 16 RoPE dims), YaRN with mscale; layer 0
        # dense, the others 8 routed experts in 4 groups (2 groups, then 2 experts a token) and a shared one
        config = transformers.DeepseekV3Config(
            **common, q_lora_rank=48, kv_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
            n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=intermediate_size // 4,
            num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, rope_theta=10000.0, rope_scaling={
                "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    elif family == "gemma2":  # windows of 16 tokens on even layers, soft-capped scores and logits
        config = transformers.Gemma2Config(**common, head_dim=hidden_size // num_heads, rope_theta=10000.0,
                                           sliding_window=16, query_pre_attn_scalar=12, attn_logit_softcapping=4.0,
                                           final_logit_softcapping=8.0, hidden_activation="gelu_pytorch_tanh")
    elif family == "gemma3":  # text only; every other layer slides over 16 tokens with its own RoPE base
        config = transformers.Gemma3TextConfig(**common, head_dim=hidden_size // num_heads, rope_theta=100000.0,
                                               rope_local_base_freq=10000.0, sliding_window=16,
                                               layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
                                               query_pre_attn_scalar=12, rope_scaling={"rope_type": "linear",
                                                                                       "factor": 2.0})
    elif family == "olmo2":
        config = transformers.Olmo2Config(**common, rope_theta=10000.0)
    else:
        raise ValueError(f"unknown family {family!r}; use llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, phi3, "
                         "gpt_oss, deepseek_v3, olmo2, gemma2 or gemma3")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    _randomize_biases(model, initializer_range)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _patch_config_for_levanter(out, family)
    return out


def _randomize_biases(model, scale: float) -> None:
    """transformers initialises biases (Qwen2's q/k/v, gpt-oss's experts') and gpt-oss's attention
    sinks to zero or nearly; random ones make parity tests check that they are loaded."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".bias", "_bias")):
                param.normal_(0.0, scale)
            elif name.endswith(".sinks"):
                param.normal_(0.0, 1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's routing bias (a buffer, saved)
                buffer.normal_(0.0, scale)


def _patch_config_for_levanter(out: Path, family: str) -> None:
    """levanter's Qwen2 reader takes biases from a `no_bias` flag that HF configs do not carry."""
    if family != "qwen2":
        return
    path = out / "config.json"
    config = json.loads(path.read_text())
    config.setdefault("no_bias", False)
    path.write_text(json.dumps(config, indent=2))


def make_bert_checkpoint(
    out_dir: str | Path,
    pooling: str | tuple[str, ...] = "mean",
    normalize: bool = True,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 64,
    vocab_size: int = 100,
    max_position_embeddings: int = 128,
    max_seq_length: int | None = 64,
    hidden_act: str = "gelu",
    initializer_range: float = 0.2,
    bert_prefix: bool = False,
    seed: int = 0,
) -> Path:
    """Write a random `BertModel` in the sentence-transformers layout (no tokenizer: tests send ids).

    `pooling`: one or several of "mean", "cls", "max", "mean_sqrt_len" (1_Pooling/config.json);
    `normalize` adds a Normalize module to modules.json; `max_seq_length` (None: no
    sentence_bert_config.json); `bert_prefix` saves the weights as `bert.*`, as BertFor* heads do.
    Biases and LayerNorm weights are random too, so a parity test sees each one loaded.
    """
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = transformers.BertConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings, hidden_act=hidden_act,
        initializer_range=initializer_range, pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "LayerNorm" in name:
                param.add_(torch.randn_like(param) * initializer_range)
    model.save_pretrained(out, safe_serialization=True)
    if bert_prefix:
        weights = out / "model.safetensors"
        renamed = {f"bert.{k}": v.contiguous() for k, v in load_file(weights).items()}
        save_file(renamed, weights, metadata={"format": "pt"})
    modes = (pooling,) if isinstance(pooling, str) else tuple(pooling)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden_size,
        "pooling_mode_cls_token": "cls" in modes,
        "pooling_mode_mean_tokens": "mean" in modes,
        "pooling_mode_max_tokens": "max" in modes,
        "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len" in modes,
    }, indent=2))
    if max_seq_length is not None:
        (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return out


def make_lora_adapter(model_dir: str | Path, out_dir: str | Path, *, rank: int = 4, alpha: float = 8.0,
                      targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                      seed: int = 0, scale: float = 0.3, **config) -> Path:
    """Write a random PEFT LoRA adapter of `model_dir`'s model (both factors random: PEFT starts B
    at zero, which adapts nothing). `config`: more LoraConfig fields (use_rslora, rank_pattern, ...)."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                                                     lora_dropout=0.0, **config))
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, scale)
    lora.save_pretrained(str(out_dir), safe_serialization=True)
    return Path(out_dir)


def peft_model(model_dir: str | Path, adapter_dir: str | Path):
    """transformers + peft: the reference for an adapter's output (float32, eval mode)."""
    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()


WHISPER_TASKS = ("<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                 "<|notimestamps|>")
"""Whisper's special tokens after the language tokens, in its vocabulary's order."""


def make_whisper_tokenizer(text_vocab: int = 300, text_tokens: int | None = None):
    """A byte-level BPE tokenizer laid out as Whisper's: text tokens (BPE up to `text_vocab`, then
    filler tokens `<f123>` up to `text_tokens`, as Whisper's 50257), then <|endoftext|>,
    <|startoftranscript|>, one token per language of transformers' LANGUAGES, the task tokens
    (WHISPER_TASKS) and 1501 timestamps <|0.00|> .. <|30.00|>, each id one more than the last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=text_vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    if text_tokens is not None:
        tok.add_tokens([f"<f{i}>" for i in range(tok.get_vocab_size(), text_tokens)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    specials = ["<|startoftranscript|>", *(f"<|{code}|>" for code in LANGUAGES), *WHISPER_TASKS]
    fast.add_special_tokens({"additional_special_tokens": specials})
    fast.add_tokens([f"<|{i * 0.02:.2f}|>" for i in range(1501)])
    return fast


def make_whisper_checkpoint(out_dir: str | Path, *, d_model: int = 64, num_layers: int = 2, num_heads: int = 4,
                            ffn_dim: int = 128, num_mel_bins: int = 80, max_target_positions: int = 64,
                            initializer_range: float = 0.2, seed: int = 0, text_tokens: int | None = None) -> Path:
    """Write a random multilingual `WhisperForConditionalGeneration` with its tokenizer,
    generation_config.json (language and task ids, suppressed tokens, timestamp settings as the
    real checkpoints have them) and preprocessor_config.json. A short `max_target_positions` keeps
    a window's decode short (a random model rarely stops early); `text_tokens` pads the text
    vocabulary (50257 as Whisper's: with this tokenizer's 100 languages, 51866 ids in all)."""
    import torch
    import transformers
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_whisper_tokenizer(text_tokens=text_tokens)
    ids = tokenizer.convert_tokens_to_ids
    eot, sot = ids("<|endoftext|>"), ids("<|startoftranscript|>")
    config = transformers.WhisperConfig(
        vocab_size=len(tokenizer), num_mel_bins=num_mel_bins, d_model=d_model, encoder_layers=num_layers,
        decoder_layers=num_layers, encoder_attention_heads=num_heads, decoder_attention_heads=num_heads,
        encoder_ffn_dim=ffn_dim, decoder_ffn_dim=ffn_dim, max_target_positions=max_target_positions,
        init_std=initializer_range, eos_token_id=eot, bos_token_id=eot, pad_token_id=eot,
        decoder_start_token_id=sot)
    torch.manual_seed(seed)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "layer_norm" in name:
                param.add_(torch.randn_like(param) * initializer_range)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    space = ids("Ġ")
    generation = {
        "decoder_start_token_id": sot, "eos_token_id": eot, "pad_token_id": eot, "bos_token_id": eot,
        "max_length": max_target_positions, "is_multilingual": True, "return_timestamps": False,
        "lang_to_id": {f"<|{code}|>": ids(f"<|{code}|>") for code in LANGUAGES},
        "task_to_id": {"translate": ids("<|translate|>"), "transcribe": ids("<|transcribe|>")},
        "no_timestamps_token_id": ids("<|notimestamps|>"), "prev_sot_token_id": ids("<|startofprev|>"),
        "max_initial_timestamp_index": 50, "begin_suppress_tokens": [space, eot],
        "alignment_heads": [[0, 1], [1, 0], [1, 3]][: 3 if num_layers > 1 else 1],
        "suppress_tokens": [1, 2, 7, 8, 9, 10, 14, 25, 26, 27, 28, 29, 31, 58, 59, 60, 61, 62, 63, 90, 91, 92, 93],
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    transformers.WhisperFeatureExtractor(feature_size=num_mel_bins).save_pretrained(out)
    return out


def make_llava_checkpoint(out_dir: str | Path, *, seed: int = 0, image_size: int = 32, patch_size: int = 8) -> Path:
    """Write a random `LlavaForConditionalGeneration`: a small CLIP tower (LLaVA-1.5's settings:
    feature layer -2, "default") and a Llama decoder over `make_tokenizer`'s vocabulary plus an
    `<image>` token, with its CLIPImageProcessor and the ChatML template."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    initializer_range=0.2, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                    pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    vision = transformers.CLIPVisionConfig(image_size=image_size, patch_size=patch_size, hidden_size=32,
                                           intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                           projection_dim=32)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                      image_token_index=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in ("bias", "norm", "layrnorm", "class_embedding")):
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    transformers.CLIPImageProcessor(size={"shortest_edge": image_size},
                                    crop_size={"height": image_size, "width": image_size}).save_pretrained(out)
    return out
