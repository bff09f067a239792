"""The `cpu` backend: the project's x86 kernels (engine/backends/cpu/kernels.cc) where XLA is slow
on CPU. One device only: the FFI calls have no partitioning rule.

- Weights: every linear layer whose output size is a multiple of 16, and the LM head (tied or not),
  becomes a `PackedLinear` (16-column panels in the weights' dtype, streamed by a register-blocked
  matmul that widens bf16 and int8 in registers; int8 weights' column scales multiply its output);
  q/k/v and a SwiGLU MLP's gate/up are fused into one
  `FusedLinear` each, so a layer makes four matmul calls instead of seven. Each product shape runs
  on the kernel or on XLA's dot, whichever is faster on this machine (engine.backends.cpu.matmul_choice).
- Activations are float32 whatever the weights' dtype (XLA's bf16 converts are slow on CPU).
- Attention: one kernel call per layer for the whole step, reading the pages in place. Every token
  is a query of its own (its row's page table, its own causal length), so causal prefill attention
  is decode attention with one query per token.
- The cache has the xla backend's layout (`SplitKVCache`); a bfloat16 cache is stored as its
  uint16 bits: XLA's CPU backend widens a bfloat16 scatter to float32 (converting the whole cache
  twice per layer and step); an integer scatter writes in place, and the kernel reads the bits as
  bfloat16.
- SwiGLU's silu(gate) * up runs on a kernel straight from the fused gate/up output; greedy
  argmax on another (XLA runs both on one thread).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import NamedArray
from levanter.layers.attention import Attention

from engine.backends.base import Q_AXES, AttentionStep, LayerAttention, visible_tokens
from engine.backends.cpu import kernels
from engine.backends.cpu.kernels import PANEL, FusedLinear, PackedLinear, silu_mul, unflatten_rows
from engine.backends.cpu.matmul_choice import XLA, MatmulChooser, Product
from engine.backends.xla import SplitKVCache, XlaBackend
from engine.core.buckets import ShapeBuckets
from engine.model.quantize import Int8Embedding, Int8Linear


class CpuBackend(XlaBackend):
    name = "cpu"
    shardable = False
    scan_layers = False
    """Unrolled by default: scanned, the kernel reads each stacked weight in place and a decode step
    costs about the same, but XLA's dot (which many-row products choose on CPUs with AVX-512 bf16
    or AMX) gets a sliced copy of the packed weight and ran a 512-token step ~35% slower."""

    def __init__(self, weight_dtype, chooser: MatmulChooser):
        self.weight_dtype = jnp.dtype(weight_dtype)
        self.chooser = chooser

    @staticmethod
    def available() -> bool:
        return kernels.available()

    def prepare(self, model, buckets: ShapeBuckets, measure: bool):
        """Pack the linear layers and the LM head, fuse q/k/v and gate/up (see the module
        docstring), and give every packed product its matmul (`measure`: time the shapes)."""
        pack = lambda m: PackedLinear.from_linear(m, self.weight_dtype) if _packable(m) else m  # noqa: E731
        layers = jax.tree_util.tree_map(pack, model.layers, is_leaf=_packable)
        if isinstance(layers, tuple):
            layers = tuple(_fuse(layer) for layer in layers)
        else:
            layers = eqx.tree_at(lambda s: s.stacked, layers, _fuse(layers.stacked))
        lm_head = model.lm_head
        Vocab = model.Vocab
        if lm_head is None and Vocab.size % PANEL == 0:  # tied: unembed with the embedding matrix
            table = model.embeddings.token_embeddings
            if isinstance(table, Int8Embedding):
                lm_head = PackedLinear.from_weight(table.weight, table.Embed, Vocab, None, jnp.int8, table.scale)
            else:
                lm_head = PackedLinear.from_weight(table.weight, table.Embed, Vocab, None, self.weight_dtype)
        elif lm_head is not None:
            lm_head = pack(lm_head)
        return self._choose_matmuls(dataclasses.replace(model, layers=layers, lm_head=lm_head), buckets, measure)

    def _choose_matmuls(self, model, buckets: ShapeBuckets, measure: bool):
        """Layers multiply every token of a step (the bucket's tokens), the LM head its rows."""
        shapes = buckets.all()
        layer_rows, head_rows = sorted({b.tokens for b in shapes}), sorted({b.rows for b in shapes})
        modules = [(m, layer_rows) for m in jax.tree_util.tree_leaves(model.layers, is_leaf=_is_packed)
                   if _is_packed(m)]
        if _is_packed(model.lm_head):
            modules.append((model.lm_head, head_rows))
        choices = self.chooser.choose([p for m, rows in modules for p in _products(m, rows)], measure)

        def choose(module, rows):
            return dataclasses.replace(module, xla_rows=frozenset(p.rows for p in _products(module, rows)
                                                                  if choices[p] == XLA))

        layers = jax.tree_util.tree_map(lambda m: choose(m, layer_rows) if _is_packed(m) else m, model.layers,
                                        is_leaf=_is_packed)
        lm_head = choose(model.lm_head, head_rows) if _is_packed(model.lm_head) else model.lm_head
        return dataclasses.replace(model, layers=layers, lm_head=lm_head)

    def activation_dtype(self, weight_dtype) -> jnp.dtype:
        return jnp.dtype(jnp.float32)

    def init_cache(self, shape) -> SplitKVCache:
        storage = self.storage_dtype(shape.dtype)
        return (Bf16BitsKVCache if storage == jnp.uint16 else SplitKVCache).zeros(shape, storage)

    def project_qkv(self, attn, h: NamedArray) -> tuple[NamedArray, NamedArray, NamedArray]:
        if isinstance(attn.q_proj, FusedLinear):  # q/k/v fused by `prepare`
            return attn.q_proj(h)
        return super().project_qkv(attn, h)

    def storage_dtype(self, dtype) -> jnp.dtype:
        dtype = jnp.dtype(dtype)
        return jnp.dtype(jnp.uint16) if dtype == jnp.bfloat16 else dtype

    def begin_step(self, inputs) -> AttentionStep:
        """Each token's visible length (the kernel reads its row's page table itself)."""
        return AttentionStep(inputs, visible_tokens(inputs))

    def attend(self, cache: SplitKVCache, layer, q, k, v, how: LayerAttention, step: AttentionStep):
        cache = cache.write(layer, step.inputs.kv_dest, k, v)
        q_arr = q.rearrange(Q_AXES).array.astype(jnp.float32) * how.scale
        inputs = step.inputs
        window = 0 if how.window is None else jnp.where(how.slides, how.window, 0)
        o = kernels.paged_attention(q_arr, cache.k, cache.v, layer, inputs.page_table, inputs.token_row, step.tables,
                                    window, how.softcap)
        return hax.named(o, Q_AXES), cache

    argmax = staticmethod(kernels.argmax)


class PackedSwiGLU(eqx.Module):
    """A SwiGLU MLP, down(silu(gate(x)) * up(x)), on packed weights: gate and up as one fused
    matmul, gated by the `silu_mul` kernel straight from its output."""

    gate_up: FusedLinear
    down_proj: eqx.Module

    def __call__(self, x: NamedArray, *, key=None) -> NamedArray:
        del key
        batch, gate_up = self.gate_up.concatenated(x)
        return self.down_proj(unflatten_rows(silu_mul(gate_up), batch, self.gate_up.Outs[0]))


class Bf16BitsKVCache(SplitKVCache):
    """A bfloat16 cache stored as its uint16 bits, which the attention kernel reads as bfloat16:
    XLA's CPU backend widens a bfloat16 scatter to float32 (converting the whole cache twice per
    layer and step), while an integer scatter writes in place."""

    def stored(self, x: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)


def _is_packed(module) -> bool:
    return isinstance(module, (PackedLinear, FusedLinear))


def _products(module, rows: list[int]) -> list[Product]:
    weight = module.weight
    width, depth = weight.resolve_axis("panel").size * PANEL, weight.resolve_axis("in").size
    return [Product(r, depth, width, str(weight.dtype)) for r in rows]


def _packable(module) -> bool:
    return isinstance(module, (hnn.Linear, Int8Linear)) and PackedLinear.packable(module)


def _fuse(layer):
    """A packed layer with q/k/v fused into `self_attn.q_proj` (which then returns all three;
    k_proj, v_proj -> None) and a SwiGLU MLP as a `PackedSwiGLU`, where all parts are packed.
    Anything else keeps its own modules."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if isinstance(attn, Attention) and _all_packed(attn.q_proj, attn.k_proj, attn.v_proj):
        fused = FusedLinear.fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        layer = eqx.tree_at(lambda m: (m.self_attn.q_proj, m.self_attn.k_proj, m.self_attn.v_proj), layer,
                            (fused, None, None))
    if _swiglu(mlp) and _all_packed(mlp.gate_proj, mlp.up_proj):
        layer = eqx.tree_at(lambda m: m.mlp, layer,
                            PackedSwiGLU(FusedLinear.fuse([mlp.gate_proj, mlp.up_proj]), mlp.down_proj))
    return layer


def _all_packed(*modules) -> bool:
    return all(isinstance(m, PackedLinear) for m in modules)


def _swiglu(mlp) -> bool:
    """An MLP computing down(act(gate(x)) * up(x)) with act = silu."""
    silu = getattr(mlp, "act", None) in (hnn.silu, hnn.swish)
    return silu and hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj")
