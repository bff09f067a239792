"""Whisper speech-to-text: levanter's model (`levanter.models.whisper`) with cached decoding.

Reads a Hugging Face Whisper checkpoint directory: config.json (model_type "whisper"),
generation_config.json (the special tokens; read by engine.transcribe.decoding) and safetensors
weights, loaded into levanter's `WhisperModel` (torch's (Out, In) linear weights transposed into
levanter's (In, Out) layout; the encoder's positions are levanter's sinusoids, which is what
Whisper's frozen `embed_positions` hold).

Three programs run it (engine.transcribe.engine compiles them):
  * `encode`: log-mel windows [batch, n_mels, 3000 frames] through levanter's encoder, then each
    decoder layer's cross-attention keys and values of the encoder output, stored in the slots
    the windows decode in. A window's encoder output is computed once.
  * `decode`: tokens [slot, position] of every slot through the decoder, each slot at its own
    offset in a self-attention cache of `max_target_positions` per slot. Returns the logits at each
    slot's last fed token and, at each slot's probe position, log P(<|nospeech|>).
  * `align`: a finished window's tokens read again without the cache, returning the alignment
    heads' cross-attention weights (word timings: engine.transcribe.alignment).

Named axes: "slot", "position" (decoder tokens fed), "key_position" (the self-attention cache),
"source" (encoder positions, 1500 per window), "heads", "head_size", "embed_dim", "vocab_size".
The decoder's layers run unrolled over per-layer modules and per-layer cache buffers
(`decoder_layers`): each step reads every cache in place (on the CPU a scanned loop copied each
layer's slab of the cross-attention cache, ~20 MB a layer at 8 slots of whisper-tiny). Whisper
decoders are shallow (4 to 32 layers), so compile time stays small. Invariant: a slot's cache
entries past the tokens it has fed are never read (attention is causal over absolute positions),
so a slot is reused without clearing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import NamedTuple

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from levanter.models.whisper import WhisperConfig, WhisperModel
from levanter.utils.activation import ActivationFunctionEnum
from safetensors.numpy import load_file

logger = logging.getLogger(__name__)

Slot, Pos, KPos, Source = "slot", "position", "key_position", "source"
_NEG = -1e9
"""Added to masked attention scores: exp() of it is 0 in float32."""


@dataclasses.dataclass(frozen=True)
class WhisperCheckpoint:
    """A Whisper checkpoint directory and what config.json says of it."""

    path: Path
    hf_config: dict
    dtype: str
    """The weights' dtype as config.json declares it (float32 when it does not say)."""

    @property
    def num_mel_bins(self) -> int:
        return self.hf_config["num_mel_bins"]

    @property
    def max_target_positions(self) -> int:
        return self.hf_config["max_target_positions"]

    @property
    def vocab_size(self) -> int:
        return self.hf_config["vocab_size"]

    @property
    def median_filter_width(self) -> int:
        """The median filter's width along the audio when timing words (config.json; Whisper's 7)."""
        return int(self.hf_config.get("median_filter_width", 7))

    def generation_config(self) -> dict:
        """generation_config.json: Whisper's special tokens, suppressed tokens and timestamp rules."""
        path = self.path / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"{self.path} has no generation_config.json; a Whisper checkpoint needs it for its "
                             "language, task and timestamp tokens (save the model with save_pretrained)")
        return json.loads(path.read_text())


def read_checkpoint(model_dir: str | Path) -> WhisperCheckpoint:
    path = Path(model_dir).expanduser().absolute()
    hf = json.loads((path / "config.json").read_text())
    if hf.get("model_type") != "whisper":
        raise ValueError(f"{path} holds a {hf.get('model_type')!r} model, not Whisper; serve it with another task")
    dtype = {"float16": "bfloat16"}.get(hf.get("torch_dtype") or hf.get("dtype") or "float32",
                                       hf.get("torch_dtype") or hf.get("dtype") or "float32")
    return WhisperCheckpoint(path, hf, dtype)


def levanter_config(checkpoint: WhisperCheckpoint):
    hf = checkpoint.hf_config
    if hf.get("scale_embedding"):
        raise ValueError(f"{checkpoint.path}: scale_embedding=true Whisper variants are not supported")
    return WhisperConfig(
        vocab_size=hf["vocab_size"], num_mel_bins=hf["num_mel_bins"], encoder_layers=hf["encoder_layers"],
        encoder_attention_heads=hf["encoder_attention_heads"], encoder_ffn_dim=hf["encoder_ffn_dim"],
        decoder_layers=hf["decoder_layers"], decoder_attention_heads=hf["decoder_attention_heads"],
        decoder_ffn_dim=hf["decoder_ffn_dim"], d_model=hf["d_model"],
        max_source_positions=hf["max_source_positions"], max_length=hf["max_target_positions"],
        activation_function=ActivationFunctionEnum(hf.get("activation_function", "gelu")),
        gradient_checkpointing=False)


def load_whisper(checkpoint: WhisperCheckpoint, dtype: str):
    """levanter's WhisperModel with the checkpoint's weights, in `dtype`."""
    config = levanter_config(checkpoint)
    shapes = eqx.filter_eval_shape(WhisperModel.init, hax.Axis("vocab_size", config.vocab_size), config,
                                   key=jax.random.PRNGKey(0))
    state = {}
    for file in sorted(checkpoint.path.glob("*.safetensors")):
        state.update(load_file(file))
    if not state:
        raise ValueError(f"{checkpoint.path} has no .safetensors weights; save the model with safe_serialization")
    state = {key.removeprefix("model."): _levanter_layout(key, value) for key, value in state.items()}
    model = hax.state_dict.from_torch_compatible_state_dict(shapes, state)
    cast = jnp.dtype(dtype)
    model = jax.tree_util.tree_map(lambda a: a.astype(cast) if eqx.is_inexact_array(a) else a, model)
    logger.info("loaded Whisper checkpoint %s (%d+%d layers, %s)", checkpoint.path, config.encoder_layers,
                config.decoder_layers, dtype)
    return model


def _levanter_layout(key: str, value: np.ndarray) -> np.ndarray:
    """torch's (Out, In) linear weight as levanter's Whisper stores it, (In, Out)."""
    linear = key.endswith(".weight") and value.ndim == 2 and ("_proj." in key or ".fc1." in key or ".fc2." in key)
    return np.ascontiguousarray(value.T) if linear and not key.startswith("proj_out") else value


class DecoderCache(NamedTuple):
    """Self-attention keys and values, one [slot, heads, key_position, head_size] array per decoder layer."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


class CrossCache(NamedTuple):
    """Cross-attention keys and values of each slot's window, one [slot, heads, source, head_size]
    array per decoder layer. Per-layer buffers, not one stacked array: a step reads each in place
    (slicing a layer out of a stack copies it on the CPU, tens of MB a step). Heads before
    positions: attention's batch axes lead, so its dots read the cache without transposing it
    (which cost 10x the attention itself at 8 slots on the CPU)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


def decoder_layers(model) -> tuple:
    """The decoder's layers as separate modules (each its own buffers), for `decode`'s unrolled loop."""
    stacked = model.decoder.transformer.layers
    return tuple(jax.tree_util.tree_map(jnp.copy, stacked.get_layer(i)) for i in range(stacked.Layers.size))


def empty_caches(model, slots: int, dtype) -> tuple[DecoderCache, CrossCache]:
    config = model.config
    heads, size = config.DecoderHeads.size, config.DecoderHeadSize.size
    layers = range(config.DecoderLayer.size)

    def zeros(length):
        return tuple(jnp.zeros((slots, heads, length, size), dtype) for _ in layers)

    return (DecoderCache(zeros(config.max_length), zeros(config.max_length)),
            CrossCache(zeros(config.max_source_positions), zeros(config.max_source_positions)))


def encode(model, layers: tuple, mel: jax.Array, slots: jax.Array, cross: CrossCache) -> CrossCache:
    """Encode windows mel [batch, n_mels, frames] and store each one's cross-attention keys and
    values in slot `slots[i]` (an index past the last slot drops that row: padding)."""
    config = model.config
    mel = hax.named(mel, ("batch", config.Mels.name, "position"))
    audio = model.encoder(mel).rename({"position": Source})  # [batch, source, embed_dim]
    ks, vs = [], []
    for layer, k_cache, v_cache in zip(layers, cross.k, cross.v):
        attn = layer.encoder_attn
        k, v = (_ordered(proj(audio), ("batch", "heads", Source), k_cache.dtype) for proj in (attn.k_proj, attn.v_proj))
        ks.append(k_cache.at[slots].set(k, mode="drop"))
        vs.append(v_cache.at[slots].set(v, mode="drop"))
    return CrossCache(tuple(ks), tuple(vs))


def decode(model, layers: tuple, tokens: jax.Array, starts: jax.Array, counts: jax.Array, probes: jax.Array,
           nospeech: int, cache: DecoderCache, cross: CrossCache) -> tuple[jax.Array, jax.Array, DecoderCache]:
    """Feed tokens [rows, T] into the first `rows` slots (rows <= the caches' slots): slot s feeds its
    first counts[s] tokens at positions starts[s] + t (counts[s] = 0: the slot is idle; its cache
    is untouched). Returns (float32 logits [rows, vocab] at each slot's last fed token, float32
    [rows] log P(nospeech) after the token at index probes[s] of the feed (meaningless where no
    probe is asked), the updated cache)."""
    config = model.config
    num_slots, length = tokens.shape
    offsets = jnp.arange(length)
    positions = starts[:, None] + offsets[None, :]  # [slot, T]
    writes = jnp.where(offsets[None, :] < counts[:, None], positions, config.max_length)  # past the end: dropped
    embeddings = model.decoder.embeddings
    x = embeddings.token_embeddings.weight.array[tokens] + embeddings.position_embeddings.weight.array[
        jnp.minimum(positions, config.max_length - 1)]
    x = hax.named(x, (Slot, Pos, config.Embed.name))
    causal = hax.named(jnp.arange(config.max_length)[None, None, :] <= positions[:, :, None], (Slot, Pos, KPos))
    slot_index = jnp.arange(num_slots)[:, None]
    rows = slice(None) if num_slots == cache.k[0].shape[0] else slice(0, num_slots)  # the rows fed
    new_k, new_v = [], []
    for layer, k_cache, v_cache, cross_k, cross_v in zip(layers, cache.k, cache.v, cross.k, cross.v):
        def attend_cached(q, k, v, k_cache=k_cache, v_cache=v_cache):
            # [slot, :, writes] indexes as [slot, position, heads, head_size]: the new keys' own order
            k_cache = k_cache.at[slot_index, :, writes].set(_ordered(k, (Slot, Pos, "heads"), k_cache.dtype),
                                                            mode="drop")
            v_cache = v_cache.at[slot_index, :, writes].set(_ordered(v, (Slot, Pos, "heads"), v_cache.dtype),
                                                            mode="drop")
            new_k.append(k_cache)
            new_v.append(v_cache)
            keys, values = (hax.named(c[rows], (Slot, "heads", KPos, "head_size")) for c in (k_cache, v_cache))
            return _attention(q, keys, values, KPos, causal)

        x, _ = _block(layer, x, attend_cached, cross_k[rows], cross_v[rows])
    x = model.decoder.transformer.layer_norm(x)
    last = hax.named(x.array[jnp.arange(num_slots), jnp.maximum(counts - 1, 0)], (Slot, config.Embed.name))
    probe = hax.named(x.array[jnp.arange(num_slots), jnp.clip(probes, 0, length - 1)], (Slot, config.Embed.name))
    logits = embeddings.unembed(last).array.astype(jnp.float32)
    probe_logits = embeddings.unembed(probe).array.astype(jnp.float32)
    nospeech_logprob = jax.nn.log_softmax(probe_logits, axis=-1)[:, nospeech]
    return logits, nospeech_logprob, DecoderCache(tuple(new_k), tuple(new_v))


def align(model, layers: tuple, tokens: jax.Array, slot: jax.Array, heads: tuple[tuple[int, int], ...],
          cross: CrossCache) -> jax.Array:
    """float32 [len(heads), T, source]: the cross-attention weights of each (layer, head) in `heads`
    for tokens [T] read from position 0 against slot `slot`'s window, no cache read or written (a
    teacher-forced pass over a finished window: the weights its decode had, row t for token t).
    Rows past the real tokens are padding; causal attention keeps them out of the real rows."""
    config = model.config
    length = tokens.shape[0]
    embeddings = model.decoder.embeddings
    x = embeddings.token_embeddings.weight.array[tokens] + embeddings.position_embeddings.weight.array[:length]
    x = hax.named(x[None], (Slot, Pos, config.Embed.name))
    positions = jnp.arange(length)
    causal = hax.named(positions[None, None, :] <= positions[None, :, None], (Slot, Pos, KPos))

    def attend_own(q, k, v):
        keys, values = (hax.named(_ordered(t, (Slot, "heads", Pos), t.dtype), (Slot, "heads", KPos, "head_size"))
                        for t in (k, v))
        return _attention(q, keys, values, KPos, causal)

    found = {}
    for index, (layer, cross_k, cross_v) in enumerate(zip(layers, cross.k, cross.v)):
        if index > max(layer for layer, _ in heads):
            break
        x, weights = _block(layer, x, attend_own, jax.lax.dynamic_slice_in_dim(cross_k, slot, 1),
                            jax.lax.dynamic_slice_in_dim(cross_v, slot, 1))
        found[index] = weights.rearrange((Slot, "heads", Pos, Source)).array[0]
    return jnp.stack([found[layer][head] for layer, head in heads])


def _block(layer, x: hax.NamedArray, self_attention, cross_k: jax.Array, cross_v: jax.Array):
    """One decoder layer: (its output, the cross-attention weights [slot, heads, position, source]).
    `self_attention(q, k, v)` attends over the layer's keys and values (a cache, or the feed's own);
    cross_k / cross_v: [slot, heads, source, head_size] of the rows fed."""
    h = layer.attn_ln(x)
    attn = layer.self_attn
    x = x + attn.out_proj(self_attention(attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)).astype(x.dtype))
    h = layer.encoder_attn_ln(x)
    cross_attn = layer.encoder_attn
    keys, values = (hax.named(c, (Slot, "heads", Source, "head_size")) for c in (cross_k, cross_v))
    weights = _attention_weights(cross_attn.q_proj(h), keys, Source, None)
    x = x + cross_attn.out_proj(hax.dot(weights, values.astype(jnp.float32), axis=Source).astype(x.dtype))
    return x + layer.mlp(layer.mlp_ln(x)), weights


def _ordered(x: hax.NamedArray, leading: tuple[str, ...], dtype) -> jax.Array:
    """x's array with the `leading` axes first, then head_size, in `dtype`."""
    return x.rearrange((*leading, "head_size")).array.astype(dtype)


def _attention(q: hax.NamedArray, k: hax.NamedArray, v: hax.NamedArray, key_axis: str, mask) -> hax.NamedArray:
    """Softmax attention of q [slot, position, heads, head_size] over k/v's `key_axis`, in float32."""
    return hax.dot(_attention_weights(q, k, key_axis, mask), v.astype(jnp.float32), axis=key_axis)


def _attention_weights(q: hax.NamedArray, k: hax.NamedArray, key_axis: str, mask) -> hax.NamedArray:
    """float32 softmax weights of q [slot, position, heads, head_size] over k's `key_axis`; q is laid
    out [slot, heads, position, head_size] first, as the caches are."""
    q = q.rearrange((Slot, "heads", Pos, "head_size"))
    scale = 1.0 / np.sqrt(q.axis_size("head_size"))
    scores = hax.dot(q.astype(jnp.float32) * scale, k.astype(jnp.float32), axis="head_size")
    if mask is not None:
        scores = hax.where(mask, scores, _NEG)
    return hax.nn.softmax(scores, axis=key_axis)
