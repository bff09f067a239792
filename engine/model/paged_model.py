"""One forward pass of a levanter Llama-family model over a ragged batch, with a paged KV cache.

The weights and per-layer modules (norms, projections, rotary embeddings, MLP) are levanter's; this
module replaces only the attention kernel and the cache write, because levanter's reference
`ragged_paged_attention` loops over every token and page block, which on CPU costs far more than
the matmuls. Here attention is two dense, masked einsums:

- the decode group: `Sd` sequences with one new token each, attending to their `L` pages;
- the prefill group: `Sp` rows of up to `C` prompt tokens, attending causally to their `L` pages.

With the CPU kernels (`ServingModel.packed`), the linear layers are `PackedLinear`s, q/k/v and a
SwiGLU MLP's gate/up fused into one `FusedLinear` each (like vLLM's QKV and merged-column layers),
and all attention is `cpu_kernels.decode_attention`, which reads the pages in place: a prompt token
attends to its row's cache up to and including itself, so causal prefill attention is decode
attention with one query per token (each token gets its row's page table and its own visible
length). A SwiGLU MLP's gating, silu(gate) * up, runs on `cpu_kernels.silu_mul` (XLA's fusion of
it uses one thread), straight from the fused gate/up output.

Token layout of a step (`T = Sd + Sp * C` tokens): the decode tokens first, then each prefill row's
chunk, padded to `C`. Every token writes its key/value to `kv_dest` (a flat slot index,
page * page_size + slot) before attention reads the pages, so a row sees its own chunk. Padding
tokens write to page 0, a scratch page the allocator never hands out.

Two layer loops (`ServingModel.from_levanter(model, scan_layers)`):
- unrolled (default): each layer keeps its own weight buffers. Fastest steps on CPU, but compile
  time grows with depth.
- scanned: one `haliax.scan` over levanter's stacked layers; compile time independent of depth,
  but XLA on CPU copies every layer's weights out of the stack on every step (a dynamic-slice it
  cannot fuse into the matmul), which about triples the weight traffic of a batch-1 step.
The cache is donated and updated in place either way.
"""

from __future__ import annotations

from typing import NamedTuple

import equinox as eqx
import haliax as hax
import jax
import haliax.nn as hnn
import jax.numpy as jnp
from haliax import NamedArray
from levanter.layers.attention import Attention

from engine.attention.cpu_kernels import PANEL, FusedLinear, PackedLinear, decode_attention, silu_mul, unflatten_rows

NEG_INF = -1e30


class KVCache(eqx.Module):
    """Keys f[layer, page, kv_head, head_dim, slot] and values f[layer, page, kv_head, slot,
    head_dim]. A page is one contiguous block, so gathering a row's pages copies whole blocks;
    keys keep the token position minor, as the decode reduction wants it.

    For the CPU kernels a bfloat16 cache is stored as its uint16 bits: XLA's CPU backend widens a
    bfloat16 scatter to float32 (converting the whole cache twice per layer and step) and copies
    the cache for a bitcast; an integer scatter writes in place, and the kernel reads the bits as
    bfloat16."""

    k: jax.Array
    v: jax.Array

    @property
    def page_size(self) -> int:
        return self.k.shape[-1]

    @staticmethod
    def storage_dtype(dtype, kernels: bool):
        """The dtype the cache is stored in: bfloat16 becomes its uint16 bits with the CPU kernels."""
        dtype = jnp.dtype(dtype)
        return jnp.dtype(jnp.uint16) if kernels and dtype == jnp.bfloat16 else dtype

    @staticmethod
    def init(num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype) -> "KVCache":
        k = jnp.zeros((num_layers, num_pages, kv_heads, head_dim, page_size), dtype)
        v = jnp.zeros((num_layers, num_pages, kv_heads, page_size, head_dim), dtype)
        return KVCache(k, v)


class ServingModel(eqx.Module):
    """A levanter LM-head model's modules, arranged for serving: `layers` is a tuple of per-layer
    modules (unrolled loop) or levanter's `Stacked` layers (scanned loop). When `packed`, linear
    layers are `PackedLinear`s (the CPU matmul kernel) and activations are float32."""

    embeddings: eqx.Module
    layers: tuple | eqx.Module
    norm: eqx.Module
    lm_head: eqx.Module | None
    packed: bool = eqx.field(static=True, default=False)

    @staticmethod
    def from_levanter(model, scan_layers: bool = False, packed_dtype=None) -> "ServingModel":
        """`packed_dtype`: run every linear layer whose output size is a multiple of 16 (and the LM
        head, tied or not) on the CPU matmul kernel with weights packed in that dtype."""
        layers = model.transformer.layers
        if not scan_layers:
            layers = tuple(jax.tree_util.tree_map(jnp.copy, layer) for layer in layers.unstacked())
        lm_head = model.lm_head
        if packed_dtype is None:
            return ServingModel(model.embeddings, layers, model.transformer.norm, lm_head)
        pack = lambda m: PackedLinear.from_linear(m, packed_dtype) if _packable(m) else m  # noqa: E731
        layers = jax.tree_util.tree_map(pack, layers, is_leaf=_packable)
        if scan_layers:
            layers = eqx.tree_at(lambda s: s.stacked, layers, _fuse_projections(layers.stacked))
        else:
            layers = tuple(_fuse_projections(layer) for layer in layers)
        if lm_head is None and model.Vocab.size % PANEL == 0:  # tied: unembed with the embedding matrix
            embedding = model.embeddings.token_embeddings.weight
            lm_head = PackedLinear.from_weight(embedding, model.Embed, model.Vocab, None, packed_dtype)
        elif lm_head is not None:
            lm_head = pack(lm_head)
        return ServingModel(model.embeddings, layers, model.transformer.norm, lm_head, packed=True)


def _packable(module) -> bool:
    return isinstance(module, hnn.Linear) and PackedLinear.packable(module)


def _fuse_projections(layer):
    """A packed layer with q/k/v fused into `self_attn.q_proj` (k_proj, v_proj -> None) and a
    SwiGLU MLP's gate/up into `mlp.gate_proj` (up_proj -> None), where all parts are packed.
    `_attention` and `_mlp` know these shapes; anything else keeps its own modules."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(attn) is Attention and _all_packed(attn.q_proj, attn.k_proj, attn.v_proj):
        fused = FusedLinear.fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        layer = eqx.tree_at(lambda m: (m.self_attn.q_proj, m.self_attn.k_proj, m.self_attn.v_proj), layer,
                            (fused, None, None))
    if _swiglu(mlp) and _all_packed(mlp.gate_proj, mlp.up_proj):
        fused = FusedLinear.fuse([mlp.gate_proj, mlp.up_proj])
        layer = eqx.tree_at(lambda m: (m.mlp.gate_proj, m.mlp.up_proj), layer, (fused, None))
    return layer


def _all_packed(*modules) -> bool:
    return all(isinstance(m, PackedLinear) for m in modules)


def _swiglu(mlp) -> bool:
    """An MLP computing down(act(gate(x)) * up(x)) with act = silu."""
    silu = getattr(mlp, "act", None) in (hnn.silu, hnn.swish)
    return silu and hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj")


class StepInputs(NamedTuple):
    """The arrays of one step; shapes are fixed by the runner's bucket (Sd, Sp, L). A NamedTuple,
    so that jit flattens it in C++ (host time per step counts at batch 1)."""

    tokens: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    kv_dest: jax.Array  # i32[T] flat slot per token; padding -> scratch page 0
    dec_pages: jax.Array  # i32[Sd, L] page table of decode rows (padding -> 0)
    dec_lens: jax.Array  # i32[Sd] tokens in cache after this step (0 for padding rows)
    pre_pages: jax.Array  # i32[Sp, L]
    pre_lens: jax.Array  # i32[Sp] tokens in cache after this step
    pre_start: jax.Array  # i32[Sp] position of the row's first token
    sample_index: jax.Array  # i32[R = Sd + Sp] token whose logits each row samples from


def forward(model: ServingModel, cache: KVCache, inputs: StepInputs) -> tuple[NamedArray, KVCache]:
    """Run every layer over the step's tokens. Returns final hidden states (position, embed)
    and the updated cache."""
    Pos = hax.Axis("position", inputs.tokens.shape[0])
    x = model.embeddings.embed(hax.named(inputs.tokens, Pos))
    if model.packed:
        x = x.astype(jnp.float32)
    pos_ids = hax.named(inputs.positions, Pos)
    k_all, v_all = cache.k, cache.v
    tables = _token_tables(inputs) if model.packed else None
    rot_embs = _rotary_embeddings(model)
    rope = rotary_tables(rot_embs, pos_ids, x.dtype) if model.packed and rot_embs is not None else None
    if isinstance(model.layers, tuple):
        for index, layer in enumerate(model.layers):
            x, k_all, v_all = _decoder_layer(layer, x, k_all, v_all, index, pos_ids, inputs, tables, rope)
    else:
        def layer_step(carry, layer):
            x, k_all, v_all, index = carry
            x, k_all, v_all = _decoder_layer(layer, x, k_all, v_all, index, pos_ids, inputs, tables, rope)
            return (x, k_all, v_all, index + 1), None

        init = (x, k_all, v_all, jnp.int32(0))
        (x, k_all, v_all, _), _ = hax.scan(layer_step, model.layers.Block)(init, model.layers.stacked)
    return model.norm(x), KVCache(k_all, v_all)


def logits_at(model: ServingModel, hidden: NamedArray, index: jax.Array) -> NamedArray:
    """Logits (row, vocab) of the tokens at `index` (a gather before the vocabulary matmul)."""
    rows = hidden["position", hax.named(index, "row")]
    if model.lm_head is not None:
        return model.lm_head(rows, key=None)
    return model.embeddings.unembed(rows)


def _token_tables(inputs: StepInputs) -> tuple[jax.Array, jax.Array]:
    """Every token's page table i32[T, L] and visible tokens i32[T] (0 for padding tokens), decode
    tokens first: prefill token j of row r sees positions [0, pre_start[r] + j]."""
    rows = inputs.pre_pages.shape[0]
    if rows == 0:
        return inputs.dec_pages, inputs.dec_lens
    chunk = (inputs.tokens.shape[0] - inputs.dec_pages.shape[0]) // rows
    position = inputs.pre_start[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [Sp, C]
    lens = jnp.where(position < inputs.pre_lens[:, None], position + 1, 0).reshape(-1)
    pages = jnp.repeat(inputs.pre_pages, chunk, axis=0)
    return (jnp.concatenate([inputs.dec_pages, pages]), jnp.concatenate([inputs.dec_lens, lens]))


def _rotary_embeddings(model: ServingModel):
    """The layers' rotary embedding module (one config for all layers), or None."""
    layer = model.layers[0] if isinstance(model.layers, tuple) else model.layers.stacked
    return getattr(getattr(layer, "self_attn", None), "rot_embs", None)


def rotary_tables(rot_embs, pos_ids: NamedArray, dtype) -> tuple[NamedArray, NamedArray]:
    """(cos, sin) of a levanter rotary embedding at every position, (position, head_size), for
    `rotate`; computed once per step.

    levanter's rotary modules (default, llama3, yarn) compute `q * cos + rotate_half(q) * sin` with
    cos and sin of angles `concat(f, f)` that depend on the position only, and XLA fuses cos and sin
    into that product: it evaluated both for every element of q and k, every head of every layer
    (~24 ms of a 512-token step on CPU). Rotating x = (1, .., 1, 0, .., 0) gives (cos f, sin f)
    exactly; the optimization barrier keeps XLA from fusing them back into each layer."""
    Head = rot_embs.HeadDim
    half = Head.size // 2
    first_half = hax.named(jnp.arange(Head.size) < half, Head).astype(dtype)
    rotated = rot_embs(first_half.broadcast_axis(pos_ids.axes), pos_ids)
    cos, sin = rotated[Head, :half], rotated[Head, half:]
    tables = hax.concatenate(Head, (cos, cos)), hax.concatenate(Head, (sin, sin))
    return jax.lax.optimization_barrier(tables)


def rotate(x: NamedArray, rope: tuple[NamedArray, NamedArray], Head: hax.Axis) -> NamedArray:
    """levanter's rotary embedding of x with `rotary_tables`: x * cos + rotate_half(x) * sin."""
    cos, sin = rope
    half = Head.size // 2
    rotated_half = hax.concatenate(Head, (-x[Head, half:], x[Head, :half]))
    return x * cos + rotated_half * sin


def _decoder_layer(layer, x, k_all, v_all, index, pos_ids, inputs: StepInputs, tables, rope):
    residual = x
    h = layer.input_layernorm(x)
    attn_out, k_all, v_all = _attention(layer.self_attn, h, k_all, v_all, index, pos_ids, inputs, tables, rope)
    if getattr(layer, "post_attn_layernorm", None) is not None:
        attn_out = layer.post_attn_layernorm(attn_out)
    x = residual + attn_out
    residual = x
    mlp_out = _mlp(layer.mlp, layer.post_attention_layernorm(x))
    if getattr(layer, "post_mlp_layernorm", None) is not None:
        mlp_out = layer.post_mlp_layernorm(mlp_out)
    return residual + mlp_out, k_all, v_all


def _mlp(mlp, x: NamedArray) -> NamedArray:
    """The layer's MLP; a SwiGLU MLP on packed weights gates with the `silu_mul` kernel."""
    if not (_swiglu(mlp) and isinstance(mlp.gate_proj, FusedLinear)):
        return mlp(x)
    batch, gate_up = mlp.gate_proj.concatenated(x)
    return mlp.down_proj(unflatten_rows(silu_mul(gate_up), batch, mlp.gate_proj.Outs[0]))


def _attention(attn, h, k_all, v_all, index, pos_ids, inputs: StepInputs, tables, rope):
    """`tables`: every token's (page table, visible tokens) for the CPU attention kernel, or None
    for XLA's masked einsums. `rope`: `rotary_tables`, or None to let the layer compute its own."""
    q, k, v = _qkv(attn, h, pos_ids, rope)
    q_arr = q.rearrange(("position", "kv_head", "q_heads_per_group", "head_size")).array
    k_arr = _cache_values(k.rearrange(("position", "kv_head", "head_size")).array, k_all.dtype)
    v_arr = _cache_values(v.rearrange(("position", "kv_head", "head_size")).array, v_all.dtype)
    page_size = k_all.shape[-1]
    page, slot = inputs.kv_dest // page_size, inputs.kv_dest % page_size
    k_all = k_all.at[index, page, :, :, slot].set(k_arr)
    v_all = v_all.at[index, page, :, slot].set(v_arr)

    scale = attn.config.scaling_factor or 1.0 / (q_arr.shape[-1] ** 0.5)
    q_arr = q_arr.astype(jnp.float32) * scale
    if tables is not None:
        o = decode_attention(q_arr, k_all, v_all, index, *tables)
    else:
        num_dec = inputs.dec_pages.shape[0]
        out = [] if num_dec == 0 else [_decode_attention(q_arr[:num_dec], k_all, v_all, index, inputs)]
        if inputs.pre_pages.shape[0]:
            out.append(_prefill_attention(q_arr[num_dec:], k_all, v_all, index, inputs))
        o = jnp.concatenate(out, axis=0) if len(out) > 1 else out[0]
    o = hax.named(o, ("position", "kv_head", "q_heads_per_group", "head_size"))
    o = o.flatten_axes(("kv_head", "q_heads_per_group"), "heads").astype(h.dtype)
    return attn.o_proj(o, key=None), k_all, v_all


def _qkv(attn, h, pos_ids, rope):
    """levanter's `Attention._compute_qkv`, with q/k/v from one fused projection when packed."""
    if not isinstance(attn.q_proj, FusedLinear):
        return attn._compute_qkv(h, key=None, pos_ids=pos_ids)
    q, k, v = attn.q_proj(h)
    if attn.config.qk_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    if rope is not None:
        q, k = rotate(q, rope, attn.rot_embs.HeadDim), rotate(k, rope, attn.rot_embs.HeadDim)
    elif attn.rot_embs is not None:
        q = attn.rot_embs(q, pos_ids).astype(q.dtype)
        k = attn.rot_embs(k, pos_ids).astype(k.dtype)
    return q, k, v


def _cache_values(x: jax.Array, dtype) -> jax.Array:
    """x in the cache's storage dtype; a uint16 cache holds bfloat16 bits (see KVCache)."""
    if dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(dtype)


def _gather_pages(k_all, v_all, index, pages):
    """Each row's keys f32[row, kv_head, head_dim, K] and values f32[row, kv_head, K, head_dim],
    K = pages per row * page_size: the key position is the minor axis of both reductions below."""
    rows, num_pages = pages.shape
    k = k_all[index, pages].transpose(0, 2, 3, 1, 4)  # [row, head, dim, L, slot]
    v = v_all[index, pages].transpose(0, 2, 1, 3, 4)  # [row, head, L, slot, dim]
    k = k.reshape(rows, k.shape[1], k.shape[2], -1).astype(jnp.float32)
    v = v.reshape(rows, v.shape[1], -1, v.shape[-1]).astype(jnp.float32)
    return k, v


def _decode_attention(q, k_all, v_all, index, inputs: StepInputs):
    """q: f32[Sd, kv_head, group, head_dim] (pre-scaled), one query per row at position dec_lens - 1.

    Written as broadcast-multiply-reduce rather than einsum: XLA on CPU runs these many tiny
    (group x head_dim x K) matmuls several times slower than a vectorised reduction."""
    k, v = _gather_pages(k_all, v_all, index, inputs.dec_pages)
    scores = (q[..., None] * k[:, :, None]).sum(axis=3)  # [Sd, h, g, K]
    visible = jnp.arange(k.shape[-1])[None, :] < inputs.dec_lens[:, None]  # [Sd, K]
    weights = _masked_softmax(scores, visible[:, None, None, :])
    return (weights[..., None] * v[:, :, None]).sum(axis=3)  # [Sd, h, g, d]


def _prefill_attention(q, k_all, v_all, index, inputs: StepInputs):
    """q: f32[Sp * C, kv_head, group, head_dim] (pre-scaled); row r's token j is at pre_start[r] + j."""
    rows = inputs.pre_pages.shape[0]
    q = q.reshape(rows, -1, *q.shape[1:])  # [Sp, C, h, g, d]
    k, v = _gather_pages(k_all, v_all, index, inputs.pre_pages)
    scores = jnp.einsum("schgd,shdk->shgck", q, k)
    q_pos = inputs.pre_start[:, None] + jnp.arange(q.shape[1])[None, :]  # [Sp, C]
    visible = jnp.arange(k.shape[-1])[None, None, :] <= q_pos[:, :, None]  # causal, within the row
    weights = _masked_softmax(scores, visible[:, None, None, :, :])
    out = jnp.einsum("shgck,shkd->schgd", weights, v)
    return out.reshape(-1, *out.shape[2:])


def _masked_softmax(scores, visible):
    """Softmax over the last axis where visible. Rows with nothing visible (padding) get finite
    garbage that the caller never reads."""
    return jax.nn.softmax(jnp.where(visible, scores, NEG_INF), axis=-1)
