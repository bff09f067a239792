"""One forward pass of a levanter Llama-family model (Llama, Mistral, Mixtral, Qwen 2 / 3, OLMo 2,
Gemma 2 / 3) over a step's tokens, with a paged KV cache; what a family changes beyond Llama's pass
comes from config.json (engine.models.variant).

The weights and per-layer modules (norms, projections, MLP) are levanter's; the
attention backend (engine.backends) owns the q/k/v projection, the cache write and attention
itself, and may have replaced modules with its own (the cpu backend's packed and fused
projections; a packed SwiGLU MLP is called as any MLP).

The rotary embedding's cos and sin are computed once per step (engine.layers.rope, as transformers
computes them from config.json) and every layer rotates q and k with them: left to itself, XLA
fused cos and sin into each layer's rotation and evaluated them for every element of q and k.

Two layer loops (`ServingModel.from_levanter(model, rope, scan_layers)`):
- scanned: one loop over levanter's stacked layers; the program holds one layer, so compile time
  does not grow with depth. The loop indexes the stack rather than slicing it: modules that read
  a stacked weight in place (the cpu backend's packed projections) get the whole stack and the
  layer index; other weights are sliced per layer (a dynamic slice, which XLA on CPU copies).
- unrolled: each layer keeps its own weight buffers; compile time grows with depth.
Each backend says which it runs by default (`AttentionBackend.scan_layers`); a model whose layers
differ (engine.models.decoder's mix of dense and sparse MLPs) runs unrolled. The cache is donated
and updated in place either way.

LoRA (engine.layers.lora): with a pool of adapters, each adaptable projection's output gets its
tokens' updates (each token its own row's adapter); an adapted gated MLP then runs its three
projections one by one.
"""

from __future__ import annotations

import functools
from typing import Optional

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray
from haliax.nn.scan import BlockSeq

from engine.backends.base import KV_AXES, Q_AXES, AttentionBackend, LayerAttention
from engine.layers.latent_attention import LatentAttention
from engine.layers.lora import LayerLora, LoraPool
from engine.layers.moe import MoE
from engine.layers.rope import Rope, rotate
from engine.models.variant import Variant
from engine.step.plan import StepInputs


class ServingModel(eqx.Module):
    """A levanter LM-head model's modules, arranged for serving: `layers` is a tuple of per-layer
    modules (unrolled loop) or levanter's `Stacked` layers (scanned loop); `rope` the model's
    rotary embedding (its layers' levanter modules are not used)."""

    embeddings: eqx.Module
    layers: tuple | eqx.Module
    norm: eqx.Module
    lm_head: eqx.Module | None
    rope: Rope = eqx.field(static=True)
    variant: Variant = eqx.field(static=True, default=Variant())

    @staticmethod
    def from_levanter(model, rope: Rope, scan_layers: bool = False, place=lambda layer: layer,
                      variant: Variant = Variant()) -> "ServingModel":
        """`place` puts each unstacked layer on its devices as it is made (a slice of a stacked
        array is not split as the stack was), so no more than one layer is ever replicated."""
        layers = model.transformer.layers
        if isinstance(layers, BlockSeq):  # layers unlike each other (dense and sparse MLPs) are never scanned
            layers = tuple(place(layer) for layer in layers.blocks)
        elif not scan_layers:
            layers = tuple(place(_layer_of(layers, jnp.int32(i))) for i in range(layers.Block.size))
        return ServingModel(model.embeddings, layers, model.transformer.norm, model.lm_head, rope, variant)

    @property
    def Embed(self) -> hax.Axis:
        return self.embeddings.token_embeddings.Embed

    @property
    def Vocab(self) -> hax.Axis:
        return self.embeddings.token_embeddings.Vocab

    @property
    def first_layer(self):
        return self.layers[0] if isinstance(self.layers, tuple) else self.layers.stacked


@eqx.filter_jit
def _layer_of(layers, index: jax.Array):
    """Layer `index` of a stack, as arrays of its own. The index is traced: every layer is cut by
    the same one program (a replica compiles or loads one, not a slice and a copy per weight)."""
    return layers.get_layer(index)


class ImageRows(eqx.Module):
    """The image features the devices hold (engine.generate.images): `slots` images of
    `tokens_per_image` rows each, f[slots x tokens_per_image, embed] in the embeddings' dtype. A
    token id at or past `vocab_size` is an image token and embeds as its row."""

    rows: jax.Array
    vocab_size: int = eqx.field(static=True)
    tokens_per_image: int = eqx.field(static=True)
    slots: int = eqx.field(static=True)

    def embed(self, model: ServingModel, tokens: NamedArray) -> NamedArray:
        offset = tokens.array - self.vocab_size
        is_image = offset >= 0
        row = (offset // self.tokens_per_image % self.slots) * self.tokens_per_image + offset % self.tokens_per_image
        text = model.embeddings.embed(hax.named(jnp.where(is_image, 0, tokens.array), tokens.axes))
        image = hax.named(self.rows[jnp.where(is_image, row, 0)].astype(text.dtype), text.axes)
        return hax.where(hax.named(is_image, tokens.axes), image, text)


def forward(model: ServingModel, backend: AttentionBackend, cache, inputs: StepInputs,
            lora: Optional[LoraPool] = None, images: Optional[ImageRows] = None) -> tuple[NamedArray, object]:
    """Run every layer over the step's tokens (with `lora`: each adapted by its row's adapter; with
    `images`: image tokens embedded as their feature rows). Returns the final hidden states
    (position, embed) and the updated cache."""
    Pos = hax.Axis("position", inputs.tokens.shape[0])
    onehot = None if lora is None else lora.onehot(hax.named(inputs.adapter[inputs.token_row], Pos))
    adapters = lambda index: None if lora is None else lora.for_step(index, onehot)  # noqa: E731
    tokens = hax.named(inputs.tokens, Pos)
    x = model.embeddings.embed(tokens) if images is None else images.embed(model, tokens)
    if model.variant.embed_scale is not None:  # in the embeddings' dtype, as transformers rounds it
        x = x * jnp.asarray(model.variant.embed_scale, x.dtype)
    x = x.astype(backend.activation_dtype(x.dtype))
    positions = hax.named(inputs.positions, Pos)
    rope = model.rope.tables(positions, inputs.long_rope[inputs.token_row])
    local_rope = None if model.variant.local_rope is None else model.variant.local_rope.tables(positions)
    step = backend.begin_step(inputs)
    if isinstance(model.layers, tuple):
        for index, layer in enumerate(model.layers):
            layer_rope = model.variant.rope_tables(index, rope, local_rope)
            x, cache = _decoder_layer(layer, x, cache, index, layer_rope, backend, step, model.variant,
                                      adapters(index))
    else:
        Block, stacked = model.layers.Block, model.layers.stacked

        def layer_step(index, carry):
            x, cache = carry
            layer_rope = model.variant.rope_tables(index, rope, local_rope)
            return _decoder_layer(layer_at(stacked, Block, index), x, cache, index, layer_rope, backend, step,
                                  model.variant, adapters(index))

        x, cache = jax.lax.fori_loop(0, Block.size, layer_step, (x, cache))
    return model.norm(x), cache


def with_previous_tokens(inputs: StepInputs, prev_tokens: jax.Array) -> StepInputs:
    """The step's inputs with the tokens the previous step is sampling (placeholders on the host,
    `inputs.prev_slot`) taken from its sampled tokens on the device."""
    tokens = jnp.where(inputs.prev_slot >= 0, prev_tokens[jnp.maximum(inputs.prev_slot, 0)], inputs.tokens)
    return inputs._replace(tokens=tokens)


def layer_at(stacked, Block: hax.Axis, index):
    """Layer `index` of a stack of layers (weights with a leading `Block` axis), for a layer loop
    that does not slice the stack itself: modules that read a stacked weight in place
    (`at_layer(Block, index)`, e.g. the cpu backend's packed projections) keep it whole; every
    other weight is sliced out."""
    def pick(leaf):
        if hasattr(leaf, "at_layer"):
            return leaf.at_layer(Block, index)
        if isinstance(leaf, NamedArray) and leaf.has_axis(Block.name):
            return leaf[Block.name, index]
        return leaf

    return jax.tree_util.tree_map(pick, stacked, is_leaf=lambda x: isinstance(x, NamedArray) or hasattr(x, "at_layer"))


def logits_at(model: ServingModel, hidden: NamedArray, index: jax.Array) -> NamedArray:
    """Logits (row, vocab) of the tokens at `index` (a gather before the vocabulary matmul)."""
    return unembed(model, hidden["position", hax.named(index, "row")])


def unembed(model: ServingModel, rows: NamedArray) -> NamedArray:
    """Logits (row, vocab) of final hidden states (row, embed): the LM head, or the tied embedding."""
    logits = model.lm_head(rows, key=None) if model.lm_head is not None else model.embeddings.unembed(rows)
    cap = model.variant.final_softcap
    return logits if cap is None else hax.tanh(logits / cap) * cap


def _decoder_layer(layer, x, cache, index, rope, backend: AttentionBackend, step, variant: Variant,
                   lora: Optional[LayerLora]):
    attend = functools.partial(_attention, layer.self_attn, cache=cache, index=index, rope=rope, backend=backend,
                               step=step, variant=variant, lora=lora)
    feed_forward = functools.partial(_feed_forward, lora=lora)
    if getattr(layer, "input_layernorm", None) is None:  # OLMo 2: each block's output normed, not its input
        attn_out, cache = attend(x)
        x = x + layer.post_attention_layernorm(attn_out)
        return x + layer.post_feedforward_layernorm(feed_forward(layer, x)), cache
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 2 / 3: each block's input and output normed
        attn_out, cache = attend(layer.input_layernorm(x))
        x = x + layer.post_attention_layernorm(attn_out)
        return x + layer.post_feedforward_layernorm(feed_forward(layer, layer.pre_feedforward_layernorm(x))), cache
    residual = x
    h = layer.input_layernorm(x)
    attn_out, cache = attend(h)
    if getattr(layer, "post_attn_layernorm", None) is not None:
        attn_out = layer.post_attn_layernorm(attn_out)
    x = residual + attn_out
    mlp_out = feed_forward(layer, layer.post_attention_layernorm(x))
    if getattr(layer, "post_mlp_layernorm", None) is not None:
        mlp_out = layer.post_mlp_layernorm(mlp_out)
    return x + mlp_out, cache


def _feed_forward(layer, h, lora: Optional[LayerLora]):
    """The layer's MLP: dense, or a mixture of experts (engine.layers.moe: `mlp`, or Mixtral's
    `block_sparse_moe`) plus Mixtral's shared MLP if it has one."""
    moe = getattr(layer, "block_sparse_moe", None)
    mlp = layer.mlp if moe is None else moe
    if lora is not None and lora.adapts("gate_proj") and not isinstance(mlp, MoE):
        return _adapted_mlp(mlp, h, lora)
    out = mlp(h, key=None)
    shared = getattr(layer, "shared_mlp", None)
    return out if shared is None else out + shared(h, key=None)


def _adapted_mlp(mlp, h, lora: LayerLora):
    """A gated MLP, down(act(gate(h)) * up(h)), each projection with its LoRA update; a backend's
    own MLP module adapts itself (`adapted`)."""
    if hasattr(mlp, "adapted"):
        return mlp.adapted(h, lora)
    gate, up, act = mlp.gate_proj(h, key=None), mlp.up_proj(h, key=None), mlp.act
    hidden = act(lora.add("gate_proj", gate, h)) * lora.add("up_proj", up, h)
    return lora.add("down_proj", mlp.down_proj(hidden, key=None), hidden)


def _attention(attn, h, *, cache, index, rope, backend: AttentionBackend, step, variant: Variant,
               lora: Optional[LayerLora]):
    if isinstance(attn, LatentAttention):  # DeepSeek's: its own projections around the backend's attention
        q, k, v = attn.project(h, rope)
        scale = attn.sizes.scaling
    else:
        q, k, v = _qkv(attn, h, rope, backend, lora)
        scale = variant.query_scale or attn.config.scaling_factor or 1.0 / (q.resolve_axis("head_size").size ** 0.5)
    how = LayerAttention(scale, variant.attn_softcap, variant.sliding_window, variant.slides(index),
                         sinks=getattr(attn, "sinks", None))
    o, cache = backend.attend(cache, index, q.rearrange(Q_AXES), k.rearrange(KV_AXES), v.rearrange(KV_AXES),
                              how, step)
    if isinstance(attn, LatentAttention):
        return attn.output(o.astype(h.dtype)), cache
    o = o.flatten_axes(("kv_head", "q_heads_per_group"), "heads").astype(h.dtype)
    out = attn.o_proj(o, key=None)
    return (out if lora is None else lora.add("o_proj", out, o)), cache


def _qkv(attn, h, rope, backend: AttentionBackend, lora: Optional[LayerLora]):
    """levanter's `Attention._compute_qkv` with the step's rotary tables; the backend projects."""
    q, k, v = backend.project_qkv(attn, h)
    if lora is not None:
        q, k, v = (lora.add(name, y, h) for name, y in zip(("q_proj", "k_proj", "v_proj"), (q, k, v)))
    if attn.config.qk_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    Head = q.resolve_axis("head_size")
    q, k = rotate(q, rope, Head), rotate(k, rope, Head)
    return q, k, v
