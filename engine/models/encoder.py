"""BERT-family encoders in haliax + equinox: BERT (`bert`) and XLM-RoBERTa (`xlm-roberta`: bge-m3,
multilingual-e5), the transformer under a sentence-transformers embedder
(engine.models.sentence_transformer) or a cross-encoder.

The forward pass is BERT's: word + position + token-type-0 embeddings and a LayerNorm, then
engine.layers.transformer's encoder layers, post-norm (bidirectional self-attention and a GELU
feed-forward block, each followed by a residual LayerNorm), q scaled before its dot with the keys.
XLM-RoBERTa differs only in its positions: transformers' create_position_ids_from_input_ids numbers
the tokens that are not the padding id from padding_idx + 1 on (a padding id keeps padding_idx), so
`max_position_embeddings - padding_idx - 1` tokens fit. Padding is masked out of attention, so a
row's states do not depend on what else shares its batch or how far it is padded.

`hidden_states(model, tokens, mask)` is the whole forward: token ids and mask [batch, position] ->
the last layer's states [batch, position, embed].

Named axes: "batch", "vocab" and the layers' ("position", "key_position", "embed", ...). Weights are
stored (In..., Out...), as `loading.inputs_first` lays out the decoder's, so no call transposes a
weight. In bfloat16, the LayerNorm statistics and the softmax run in float32.
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
import numpy as np
from safetensors.numpy import load_file

from engine.formats.checkpoint_config import declared_dtype
from engine.layers.transformer import (
    EncoderLayer,
    EncoderSizes,
    KPos,
    LayerAxes,
    LayerKeys,
    Pos,
    TorchWeights,
    layer_norm,
    load_encoder_layer,
)

logger = logging.getLogger(__name__)

Batch = "batch"
FAMILIES = ("bert", "xlm-roberta")
"""config.json model types served here."""
_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")
"""BERT's `hidden_act` values served (plain `gelu` is erf's GELU, the two others its tanh approximation)."""
BASE_PREFIXES = ("bert.", "roberta.")
"""The base model's prefix in a checkpoint saved from a `...For...` head class, dropped on load."""


@dataclasses.dataclass(frozen=True)
class EncoderConfig(EncoderSizes):
    """The sizes of a BERT-family encoder, from its config.json."""

    vocab_size: int
    max_position_embeddings: int
    dtype: str
    """The weights' dtype as config.json declares it (engine.formats.checkpoint_config.declared_dtype)."""
    padding_idx: int = -1
    """XLM-RoBERTa's pad_token_id, from which positions are numbered; -1: BERT's positions 0, 1, ..."""

    @property
    def max_positions(self) -> int:
        """The longest input the position table numbers."""
        return self.max_position_embeddings - (self.padding_idx + 1 if self.padding_idx >= 0 else 0)


def encoder_config(hf: dict, where: Path) -> EncoderConfig:
    """The config of a `bert` or `xlm-roberta` config.json (read by read_hf_config from `where`);
    ValueError for what the encoder does not implement."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r} in {where}/config.json is not a BERT-family encoder "
                         f"({', '.join(FAMILIES)})")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{where}/config.json has position_embedding_type {hf['position_embedding_type']!r}; "
                         "the embedding engine supports 'absolute' only")
    if hf.get("hidden_act", "gelu") not in _ACTIVATIONS:
        raise ValueError(f"{where}/config.json has hidden_act {hf['hidden_act']!r}; the embedding engine "
                         f"supports {', '.join(_ACTIVATIONS)}")
    return EncoderConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 512),
        layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        hidden_act=hf.get("hidden_act", "gelu"),
        dtype=declared_dtype(hf),
        padding_idx=hf.get("pad_token_id", 1) if family == "xlm-roberta" else -1,
    )


# ---- the model ----


class Embeddings(eqx.Module):
    word: hax.NamedArray
    """[vocab, embed]"""
    position: hax.NamedArray
    """[position, embed], position sized max_position_embeddings."""
    token_type: hax.NamedArray
    """[embed]: the row of token type 0 (every input is one segment)."""
    norm: hnn.LayerNorm
    padding_idx: int = eqx.field(static=True)
    """EncoderConfig.padding_idx."""

    def __call__(self, tokens: hax.NamedArray, mask: hax.NamedArray) -> hax.NamedArray:
        return layer_norm(self.norm, self.word.take("vocab", tokens) + self._positions(tokens, mask) + self.token_type)

    def _positions(self, tokens: hax.NamedArray, mask: hax.NamedArray) -> hax.NamedArray:
        """[batch, position, embed]: BERT's rows 0, 1, ...; XLM-RoBERTa's as transformers numbers them."""
        length = tokens.resolve_axis(Pos).size
        if self.padding_idx < 0:
            return self.position[Pos, :length]
        counted = ((tokens.array != self.padding_idx) & mask.array).astype(jnp.int32)
        ids = jnp.cumsum(counted, axis=-1) * counted + self.padding_idx
        Embed = self.position.resolve_axis("embed")
        return hax.named(jnp.take(self.position.rearrange((Pos, Embed)).array, ids, axis=0), (*tokens.axes, Embed))


class Encoder(eqx.Module):
    embeddings: Embeddings
    layers: tuple[EncoderLayer, ...]
    """Post-norm, q scaled before its dot with the keys, padding keys masked."""

    def __call__(self, tokens: hax.NamedArray, mask: hax.NamedArray) -> hax.NamedArray:
        """tokens, mask: [batch, position] -> last hidden states [batch, position, embed]."""
        x = self.embeddings(tokens, mask)
        key_mask = mask.rename({Pos: KPos})
        for layer in self.layers:
            x = layer(x, key_mask)
        return x


def hidden_states(model: Encoder, tokens: jax.Array, mask: jax.Array) -> hax.NamedArray:
    """tokens int32 [batch, position], mask bool [batch, position] (True at the tokens, left-aligned or
    not) -> the last layer's states [batch, position, embed], in the weights' dtype."""
    return model(hax.named(tokens, (Batch, Pos)), hax.named(mask, (Batch, Pos)))


# ---- loading ----


def load_encoder(folder: Path, config: EncoderConfig, dtype: str) -> Encoder:
    """The encoder saved in `folder` (*.safetensors of a BertModel / XLMRobertaModel, or of a
    ...For... head under `bert.` / `roberta.`; heads and the pooler are ignored) in `dtype`."""
    state = read_state_dict(folder)
    weights = TorchWeights(state.__getitem__, jnp.dtype(dtype))
    embed = LayerAxes.of(config).embed
    embeddings = Embeddings(
        word=weights.array("embeddings.word_embeddings.weight", (hax.Axis("vocab", config.vocab_size), embed)),
        position=weights.array("embeddings.position_embeddings.weight",
                               (hax.Axis(Pos, config.max_position_embeddings), embed)),
        token_type=hax.named(jnp.asarray(state["embeddings.token_type_embeddings.weight"][0], weights.dtype),
                             (embed,)),
        norm=weights.norm("embeddings.LayerNorm", embed, config.layer_norm_eps),
        padding_idx=config.padding_idx,
    )
    layers = tuple(load_encoder_layer(weights, _layer_keys(i), config, pre_norm=False, scale_query=True)
                   for i in range(config.num_layers))
    logger.info("loaded encoder %s (%d layers, hidden %d, %s)", folder, config.num_layers, config.hidden_size, dtype)
    return Encoder(embeddings, layers)


def _layer_keys(i: int) -> LayerKeys:
    """Where `BertModel` (and `XLMRobertaModel`) keep layer i's weights."""
    p = f"encoder.layer.{i}"
    return LayerKeys(query=f"{p}.attention.self.query", key=f"{p}.attention.self.key",
                     value=f"{p}.attention.self.value", out=f"{p}.attention.output.dense",
                     attn_norm=f"{p}.attention.output.LayerNorm", up=f"{p}.intermediate.dense",
                     down=f"{p}.output.dense", mlp_norm=f"{p}.output.LayerNorm")


def read_state_dict(folder: Path, prefixes: tuple[str, ...] = BASE_PREFIXES,
                    key: str = "embeddings.word_embeddings.weight",
                    what: str = "a BertModel checkpoint") -> dict[str, np.ndarray]:
    """Every tensor of the folder's *.safetensors files, named as in the base model: the first of
    `prefixes` (where a ...For... head class saves its base model) under which `key` stands is
    dropped from every name, and the heads' own tensors keep theirs; ValueError when there are no
    files, or no `key` (the folder is not `what`)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weights; the embedding engine reads safetensors only "
                         "(convert pytorch_model.bin with transformers: from_pretrained, then save_pretrained)")
    state: dict[str, np.ndarray] = {}
    for file in files:
        state.update(load_file(file))
    for prefix in prefixes:
        if f"{prefix}{key}" in state:
            state = {k.removeprefix(prefix): v for k, v in state.items()}
    if key not in state:
        raise ValueError(f"{folder} has no {key}: not {what}")
    return state
