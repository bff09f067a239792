"""Tiny random rerankers written on the spot with transformers: cross-encoders
(`BertForSequenceClassification` with a WordPiece tokenizer, `XLMRobertaForSequenceClassification`)
and a Qwen3-Reranker-shaped `Qwen3ForCausalLM` whose tokenizer has "yes" and "no" tokens. Biases and
norm weights are random too, so a parity test sees each one loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.tiny_models import make_tokenizer

WORDS = ["paris", "is", "the", "capital", "of", "france", "bananas", "are", "yellow", "a", "long", "sentence",
         "with", "many", "words", "in", "it", "short", "what", "where", "fruit", "city"]
"""The WordPiece tokenizer's words (after its specials); other words become [UNK]."""


def make_cross_encoder(out_dir: str | Path, family: str = "bert", *, seed: int = 0, vocab_size: int = 100,
                       activation: str | None = None, num_labels: int = 1) -> Path:
    """Write a random cross-encoder: `family` "bert" (two token types, with a WordPiece tokenizer of
    `vocab_size` ids: specials, WORDS, fillers) or "xlm-roberta" (one token type, pad id 1,
    max_position_embeddings 66: 64 tokens; no tokenizer). `activation` (e.g.
    "torch.nn.modules.linear.Identity") is written where sentence-transformers 4 keeps it."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sizes = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, initializer_range=0.2, num_labels=num_labels)
    if family == "bert":
        config = transformers.BertConfig(**sizes, max_position_embeddings=64, pad_token_id=0)
        model_class = transformers.BertForSequenceClassification
    else:
        config = transformers.XLMRobertaConfig(**sizes, max_position_embeddings=66, type_vocab_size=1, pad_token_id=1)
        model_class = transformers.XLMRobertaForSequenceClassification
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "LayerNorm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(out, safe_serialization=True)
    if activation is not None:
        path = out / "config.json"
        saved = json.loads(path.read_text())
        saved["sentence_transformers"] = {"activation_fn": activation}
        path.write_text(json.dumps(saved, indent=2))
    if family == "bert":
        wordpiece_tokenizer(out, vocab_size)
    return out


def wordpiece_tokenizer(out: Path, vocab_size: int):
    """A BERT tokenizer of `vocab_size` ids saved in `out`: specials, WORDS, then fillers."""
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    vocab += [f"w{i}" for i in range(vocab_size - len(vocab))]
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(out / "vocab.txt"), do_lower_case=True)
    tokenizer.save_pretrained(out)
    return tokenizer


def make_qwen3_reranker(out_dir: str | Path, *, seed: int = 0, answers: bool = True) -> Path:
    """Write a random `Qwen3ForCausalLM` (untied LM head, 256 positions) with the ChatML BPE tokenizer
    of the tests plus (with `answers`) "yes" and "no" as tokens of their own, as Qwen3-Reranker's
    vocabulary has them."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(512)
    if answers:
        tokenizer.add_tokens(["yes", "no"])
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
        initializer_range=0.1, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
