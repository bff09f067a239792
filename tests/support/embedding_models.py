"""Tiny random sentence-transformers checkpoints of the embedding families beyond BERT, written on
the spot with transformers: XLM-RoBERTa (bge-m3's layout), EmbeddingGemma (bidirectional Gemma 3,
two Dense modules) and Qwen3-Embedding (last-token pooling, a left-padding tokenizer that appends
its end-of-text token). Each has a byte-level BPE tokenizer, so sentence-transformers' own pipeline
(`SentenceTransformer(dir).encode(texts)`) is the reference. Biases and norm weights are random
too, so a parity test sees each one loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.tiny_models import _CORPUS

FAMILIES = ("xlm-roberta", "gemma3_text", "qwen3")
_TOKENIZERS = {
    # specials (ids from 0), the template around a text, pad, padding side
    "xlm-roberta": (["<s>", "<pad>", "</s>", "<unk>"], ("<s>", "</s>"), "<pad>", "right"),
    "gemma3_text": (["<pad>", "<eos>", "<bos>", "<unk>"], ("<bos>", "<eos>"), "<pad>", "right"),
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], (None, "<|endoftext|>"), "<|endoftext|>", "left"),
}


def make_tokenizer(family: str, vocab_size: int = 300):
    """A byte-level BPE tokenizer with the family's special tokens, adding them around each text as
    the family's tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials, (first, last), pad, side = _TOKENIZERS[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    around = [t for t in (first, last) if t]
    single = " ".join(([first] if first else []) + ["$A"] + [last])
    tok.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[(t, tok.token_to_id(t)) for t in around])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, bos_token=first, eos_token=last,
                                   padding_side=side)


def make_embedding_checkpoint(out_dir: str | Path, family: str, *, pooling: str = "", seed: int = 0,
                              max_seq_length: int = 64) -> Path:
    """Write a random sentence-transformers checkpoint of `family` (one of FAMILIES) with its tokenizer.

    xlm-roberta: XLMRobertaModel (max_position_embeddings 66: 64 tokens after the padding offset),
    `pooling` "cls" (bge-m3) or "mean" (multilingual-e5), Normalize. gemma3_text: Gemma3TextModel with
    bidirectional attention, layers sliding, sliding, full, sliding over config.json's window 8,
    mean pooling, Dense 32 -> 64 -> 24 without bias (Identity), Normalize. qwen3: Qwen3Model, last-token
    pooling (its Pooling config in sentence-transformers' newer `pooling_mode` form), Normalize.
    """
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(family)
    tokenizer.save_pretrained(out)
    torch.manual_seed(seed)
    model = _random_model(family, len(tokenizer), tokenizer.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    modules = [("Transformer", "")]
    if family == "gemma3_text":
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "sliding_window": 8}, indent=2))
        modules += [("Pooling", "1_Pooling"), ("Dense", "2_Dense"), ("Dense", "3_Dense"), ("Normalize", "4_Normalize")]
        _write_dense(out / "2_Dense", 32, 64)
        _write_dense(out / "3_Dense", 64, 24)
    else:
        modules += [("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")]
    mode = {"xlm-roberta": pooling or "cls", "gemma3_text": "mean", "qwen3": "lasttoken"}[family]
    _write_pooling(out / "1_Pooling", 32, mode, legacy=family != "qwen3")
    (out / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (kind, path) in enumerate(modules)], indent=2))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                               "do_lower_case": False}))
    return out


def _random_model(family: str, vocab_size: int, pad_id: int):
    import torch
    import transformers

    sizes = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 initializer_range=0.2, pad_token_id=pad_id)
    if family == "xlm-roberta":
        config = transformers.XLMRobertaConfig(**sizes, num_hidden_layers=2, max_position_embeddings=66,
                                               type_vocab_size=1, bos_token_id=0, eos_token_id=2)
        model = transformers.XLMRobertaModel(config, add_pooling_layer=False)
    elif family == "gemma3_text":
        config = transformers.Gemma3TextConfig(
            **sizes, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
            max_position_embeddings=128, use_bidirectional_attention=True, sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, bos_token_id=2, eos_token_id=1)
        model = transformers.Gemma3TextModel(config)
    else:
        config = transformers.Qwen3Config(**sizes, num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                                          max_position_embeddings=128, tie_word_embeddings=False)
        model = transformers.Qwen3Model(config)
    model.eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "norm" in name.lower():
                param.add_(torch.randn_like(param) * 0.2)
    return model


def _write_pooling(folder: Path, dimension: int, mode: str, *, legacy: bool) -> None:
    """The Pooling config as sentence-transformers 2-5.x wrote it (`pooling_mode_*` flags), or its
    newer `pooling_mode` form."""
    folder.mkdir(exist_ok=True)
    if legacy:
        config = {"word_embedding_dimension": dimension, "pooling_mode_cls_token": mode == "cls",
                  "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_max_tokens": False,
                  "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
                  "pooling_mode_lasttoken": mode == "lasttoken", "include_prompt": True}
    else:
        config = {"embedding_dimension": dimension, "pooling_mode": mode, "include_prompt": True}
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def _write_dense(folder: Path, in_features: int, out_features: int) -> None:
    """A random Dense module without bias, Identity after it (EmbeddingGemma's)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "in_features": in_features, "out_features": out_features, "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity"}, indent=2))
    weight = torch.randn(out_features, in_features) * in_features ** -0.5
    save_file({"linear.weight": weight.contiguous()}, folder / "model.safetensors")
