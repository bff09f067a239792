"""Pair scorers in haliax + equinox, the models behind `/v1/rerank` and `/v1/score`: cross-encoders
(a BERT-family encoder with transformers' sequence-classification head) and decoder rerankers (a
causal LM judging "yes" against "no").

Reads a Hugging Face `BertForSequenceClassification` or `XLMRobertaForSequenceClassification`
checkpoint (config.json and safetensors; a sentence-transformers CrossEncoder saves one, e.g.
bge-reranker-v2-m3). The encoder is engine.models.encoder's, its embeddings taken with each token's
own token type (the tokenizer's pair encoding: BERT's type 0 up to and including the first [SEP],
type 1 after it; XLM-RoBERTa has one type). The head is transformers': a dense layer and tanh on the
first token's state (BERT's pooler; XLM-RoBERTa's classifier.dense), then a projection to the one
logit (BERT's classifier; XLM-RoBERTa's classifier.out_proj). The score is sentence-transformers'
CrossEncoder activation of that logit: sigmoid, or the logit itself where config.json names Identity.

A decoder reranker (Qwen3-Reranker: config.json says only `Qwen3ForCausalLM`, so the model's config
names the task) is engine.models.decoder_embedder's causal Qwen3 forward; its score is P("yes") /
(P("yes") + P("no")) of the next token at each row's last position, which is sigmoid of the
difference of the two logits: the last state's product with lm_head's "yes" row minus its "no" row.

Padding is masked out of attention, so a pair's score does not depend on its batch. In bfloat16 the
heads run in float32 on the states they read; the scores are always float32.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from safetensors import safe_open

from engine.formats.checkpoint_config import read_hf_config
from engine.formats.transformers_files import load_tokenizer
from engine.models import decoder_embedder, encoder

logger = logging.getLogger(__name__)

Batch, Pos = "batch", "position"
HEADS = {
    "BertForSequenceClassification": ("pooler.dense", "classifier"),
    "XLMRobertaForSequenceClassification": ("classifier.dense", "classifier.out_proj"),
}
"""config.json `architectures` served, and where each keeps its head's two Linears (the dense layer
before tanh, the projection to the logit), named without the base model's prefix."""
_TOKEN_TYPES = "embeddings.token_type_embeddings.weight"
JUDGES = {"Qwen3ForCausalLM": ("no", "yes")}
"""Causal-LM architectures served as decoder rerankers, and their (against, for) answer tokens."""
_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity"}
"""sentence-transformers' CrossEncoder activations served, by the class name config.json gives."""


@dataclasses.dataclass(frozen=True)
class ClassifierCheckpoint:
    """What a sequence-classification checkpoint says about itself (no weights read)."""

    model_dir: Path
    architecture: str
    """A key of HEADS or of JUDGES."""
    config: encoder.EncoderConfig | decoder_embedder.DecoderEmbedderConfig
    type_vocab_size: int
    """Token types the embeddings tell apart (1: every token is type 0)."""
    activation: str
    """How the logit becomes the score: "sigmoid" or "identity"."""
    judge_ids: tuple[int, ...] = ()
    """A decoder reranker's (against, for) answer token ids; () for a cross-encoder."""

    @property
    def is_decoder(self) -> bool:
        return bool(self.judge_ids)


def read_checkpoint(model_dir: str | Path) -> ClassifierCheckpoint:
    """config.json of a cross-encoder or a decoder reranker; a ValueError that says what to change for
    anything else."""
    root = Path(model_dir).expanduser().absolute()
    hf = read_hf_config(root)
    architecture = (hf.get("architectures") or ["(none)"])[0]
    if architecture in JUDGES:
        judge_ids = _token_ids(root, JUDGES[architecture])
        return ClassifierCheckpoint(root, architecture, decoder_embedder.decoder_config(hf, root), 1, "sigmoid",
                                    judge_ids)
    if architecture not in HEADS:
        raise ValueError(f"{root}/config.json names architecture {architecture!r}; the score engine runs "
                         f"{' and '.join(HEADS)} cross-encoders and {' and '.join(JUDGES)} rerankers")
    labels = len(hf.get("id2label") or {}) or hf.get("num_labels", 2)
    if labels != 1:
        raise ValueError(f"{root}/config.json has {labels} labels; a cross-encoder scores with one label "
                         "(num_labels: 1)")
    return ClassifierCheckpoint(root, architecture, encoder.encoder_config(hf, root), hf.get("type_vocab_size", 2),
                                _activation(hf, root))


def _token_ids(root: Path, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """The ids of these tokens in the checkpoint's tokenizer; a ValueError for one it lacks."""
    tokenizer = load_tokenizer(root)
    ids = tuple(tokenizer.convert_tokens_to_ids(token) for token in tokens)
    unknown = [t for t, i in zip(tokens, ids) if i is None or i == tokenizer.unk_token_id]
    if unknown:
        raise ValueError(f"the tokenizer of {root} has no token {' or '.join(map(repr, unknown))}, which a decoder "
                         "reranker answers with; serve a reranker's checkpoint (e.g. Qwen3-Reranker) as task: score")
    return ids


def _activation(hf: dict, where: Path) -> str:
    """The CrossEncoder activation config.json names (sentence-transformers 4+ or 2-3), default sigmoid."""
    named = (hf.get("sentence_transformers") or {}).get("activation_fn") or \
        hf.get("sbert_ce_default_activation_function") or "Sigmoid"
    name = named.rsplit(".", 1)[-1]
    if name not in _ACTIVATIONS:
        raise ValueError(f"{where}/config.json asks for the CrossEncoder activation {named!r}; the score engine "
                         f"applies {' or '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class CrossEncoder(eqx.Module):
    encoder: encoder.Encoder
    token_types: hax.NamedArray
    """[token_type, embed]: every row of the token-type embeddings."""
    dense: hnn.Linear
    """embed -> pooled, float32: applied with tanh to the first token's state."""
    out: hnn.Linear
    """pooled -> label (size 1), float32."""
    activation: str = eqx.field(static=True)

    def __call__(self, tokens: hax.NamedArray, types: hax.NamedArray, mask: hax.NamedArray) -> hax.NamedArray:
        """tokens, types, mask: [batch, position] -> float32 scores [batch]."""
        # the encoder's embeddings add one token-type row to every token; here each token gets its own
        typed = eqx.tree_at(lambda m: m.embeddings.token_type, self.encoder, self.token_types.take("token_type", types))
        first = typed(tokens, mask)[Pos, 0].astype(jnp.float32)
        logit = self.out(hax.tanh(self.dense(first)))["label", 0]
        return hnn.sigmoid(logit) if self.activation == "sigmoid" else logit


class DecoderReranker(eqx.Module):
    decoder: decoder_embedder.DecoderEmbedder
    judge: hax.NamedArray
    """[embed], float32: lm_head's "for" row minus its "against" row."""

    def __call__(self, tokens: hax.NamedArray, types: hax.NamedArray, mask: hax.NamedArray) -> hax.NamedArray:
        """tokens, mask: [batch, position], each row's tokens first (types unused) -> float32 scores [batch]."""
        states = self.decoder(tokens, mask).rearrange((Batch, Pos, "embed")).array
        last = jnp.maximum(jnp.sum(mask.rearrange((Batch, Pos)).array, axis=1) - 1, 0)
        final = states[jnp.arange(states.shape[0]), last].astype(jnp.float32)
        return hnn.sigmoid(hax.named(final @ self.judge.array, (tokens.resolve_axis(Batch),)))


Scorer = CrossEncoder | DecoderReranker


def score(model: Scorer, tokens: jax.Array, types: jax.Array, mask: jax.Array) -> jax.Array:
    """tokens, types int32 [batch, position], mask bool [batch, position] (each row's tokens first)
    -> float32 [batch]."""
    return model(*(hax.named(a, (Batch, Pos)) for a in (tokens, types, mask))).array


def load_scorer(checkpoint: ClassifierCheckpoint, dtype: str) -> Scorer:
    """The model of `checkpoint`, its encoder's or decoder's weights in `dtype` ("float32" or "bfloat16")."""
    if checkpoint.is_decoder:
        return load_decoder_reranker(checkpoint, dtype)
    return load_cross_encoder(checkpoint, dtype)


def load_decoder_reranker(checkpoint: ClassifierCheckpoint, dtype: str) -> DecoderReranker:
    config = checkpoint.config
    against, for_ = _lm_head_rows(checkpoint.model_dir, checkpoint.judge_ids)
    judge = hax.named(jnp.asarray(for_.astype("float32") - against.astype("float32")),
                      (hax.Axis("embed", config.hidden_size),))
    model = DecoderReranker(decoder_embedder.load_decoder_embedder(checkpoint.model_dir, config, dtype), judge)
    logger.info("loaded decoder reranker %s (%s, tokens %s)", checkpoint.model_dir, checkpoint.architecture,
                checkpoint.judge_ids)
    return model


def load_cross_encoder(checkpoint: ClassifierCheckpoint, dtype: str) -> CrossEncoder:
    """The cross-encoder of `checkpoint`, its encoder's weights in `dtype` ("float32" or "bfloat16")."""
    config = checkpoint.config
    dense_key, out_key = HEADS[checkpoint.architecture]
    head = _read_tensors(checkpoint.model_dir, (_TOKEN_TYPES, *(f"{k}.{p}" for k in (dense_key, out_key)
                                                                for p in ("weight", "bias"))))
    embed, pooled = hax.Axis("embed", config.hidden_size), hax.Axis("pooled", config.hidden_size)

    def linear(prefix: str, In: hax.Axis, Out: hax.Axis) -> hnn.Linear:
        weight = hax.named(jnp.asarray(head[f"{prefix}.weight"].T, jnp.float32), (In, Out))
        return hnn.Linear(weight, hax.named(jnp.asarray(head[f"{prefix}.bias"], jnp.float32), (Out,)), In, Out)

    model = CrossEncoder(
        encoder=encoder.load_encoder(checkpoint.model_dir, config, dtype),
        token_types=hax.named(jnp.asarray(head[_TOKEN_TYPES], jnp.dtype(dtype)),
                              (hax.Axis("token_type", checkpoint.type_vocab_size), embed)),
        dense=linear(dense_key, embed, pooled),
        out=linear(out_key, pooled, hax.Axis("label", 1)),
        activation=checkpoint.activation,
    )
    logger.info("loaded cross-encoder %s (%s, %s score)", checkpoint.model_dir, checkpoint.architecture,
                checkpoint.activation)
    return model


_LM_HEADS = ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight")
"""Where a causal LM keeps its output rows: its own head, else the tied input embeddings."""


def _lm_head_rows(folder: Path, ids: tuple[int, ...]) -> list:
    """Rows `ids` of the LM head (the tied embeddings where the checkpoint has no lm_head.weight),
    read alone: the vocabulary's other rows stay on disk."""
    where = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "numpy") as tensors:
            where.update({key: file for key in tensors.keys() if key in _LM_HEADS})
    key = next((k for k in _LM_HEADS if k in where), None)
    if key is None:
        raise ValueError(f"{folder} has no lm_head.weight or embed_tokens.weight: not a causal LM checkpoint")
    with safe_open(where[key], "numpy") as tensors:
        rows = tensors.get_slice(key)
        return [rows[i: i + 1][0] for i in ids]


def _read_tensors(folder: Path, names: tuple[str, ...]) -> dict:
    """These tensors (named without the base model's prefix) from the folder's *.safetensors files."""
    found = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "numpy") as tensors:
            for key in tensors.keys():
                name = next((key.removeprefix(p) for p in encoder.BASE_PREFIXES if key.startswith(p)), key)
                if name in names:
                    found[name] = tensors.get_tensor(key)
    missing = [name for name in names if name not in found]
    if missing:
        raise ValueError(f"{folder} lacks {', '.join(missing)}: not a sequence-classification checkpoint with its "
                         "head (save it with transformers' save_pretrained)")
    return found
