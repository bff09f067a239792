"""The `cpu` backend: the project's x86 kernels (engine/backends/cpu/kernels.cc) where XLA is slow
on CPU. One device only: the FFI calls have no partitioning rule.

- Weights: every linear layer whose output size is a multiple of 16, and the LM head (tied or not),
  becomes a `PackedLinear` (16-column panels in the weights' dtype, streamed by a register-blocked
  matmul that widens bf16, int8 and float8 in registers; int8 weights' column scales multiply its
  output, float8 weights' block scales each weight as it loads); q/k/v and a SwiGLU MLP's gate/up
  are fused into one `FusedLinear` each, so a layer makes four matmul calls instead of seven. A
  mixture of experts' float expert weights become one `PackedExperts` stack per projection, each
  grouped product one kernel call (engine.backends.cpu.packed_experts). Each
  product shape runs on the kernel or on XLA's dot (in the weights' dtype or in float32), whichever
  is fastest on this machine (engine.backends.cpu.matmul_choice); float8 weights on the kernel.
- Activations are float32 whatever the weights' dtype (XLA's bf16 converts are slow on CPU).
- Attention: one kernel call per layer for the whole step, reading the pages in place. Every token
  is a query of its own (its row's page table, its own causal length), so causal prefill attention
  is decode attention with one query per token.
- The cache has the xla backend's layout (`SplitKVCache`: values alone where they are the keys,
  the kernel then scoring against the value rows); a bfloat16 cache is stored as its
  uint16 bits: XLA's CPU backend widens a bfloat16 scatter to float32 (converting the whole cache
  twice per layer and step); an integer scatter writes in place, and the kernel reads the bits as
  bfloat16.
- SwiGLU's silu(gate) * up runs on a kernel straight from the fused gate/up output; greedy
  argmax on another (XLA runs both on one thread).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import NamedArray
from levanter.layers.attention import Attention

from engine.backends.base import Q_AXES, AttentionStep, LayerAttention, visible_tokens
from engine.backends.cpu import kernels, matmul_choice
from engine.backends.cpu.kernels import (
    PANEL,
    FusedLinear,
    PackedLinear,
    silu_mul,
    unflatten_rows,
)
from engine.backends.cpu.matmul_choice import XLA_F32, XLA_PATHS, MatmulChooser, Product
from engine.backends.cpu.packed_experts import PackedExperts
from engine.backends.xla import SplitKVCache, XlaBackend
from engine.layers.fp8 import Fp8Linear
from engine.layers.quantize import Int8Embedding, Int8Linear
from engine.step.buckets import ShapeBuckets

logger = logging.getLogger(__name__)


class CpuBackend(XlaBackend):
    name = "cpu"
    platform = "cpu"
    shardable = False
    scan_layers = False
    """Unrolled by default: scanned, the kernel reads each stacked weight in place and a decode step
    costs about the same, but XLA's dot (which many-row products choose on CPUs with AVX-512 bf16
    or AMX) gets a sliced copy of the packed weight, every layer of every step."""

    def __init__(self, weight_dtype, chooser: MatmulChooser):
        self.weight_dtype = jnp.dtype(weight_dtype)
        self.chooser = chooser

    @staticmethod
    def available() -> bool:
        return kernels.available()

    def prepare(self, model, buckets: ShapeBuckets, measure: bool):
        """Pack the linear layers and the LM head, fuse q/k/v and gate/up (see the module
        docstring), and give every packed product its matmul (`measure`: time the shapes). The
        products are read off the packed model's shapes first, so each module is made once, with
        only the layouts its chosen paths read."""
        shapes = buckets.all()
        rows = {"layers": sorted({b.tokens for b in shapes}), "lm_head": sorted({b.samples for b in shapes})}
        abstract = eqx.filter_eval_shape(lambda m: self._packed(m, rows, lambda module, _: module), model)
        modules = _packed_modules(abstract, rows)
        products = [p for m, at in modules for p in _products(m, at)]
        choices = self.chooser.choose(products, measure, widen=_widening_fits(modules))

        def keep(module, at):
            products = _products(module, at)
            xla_rows = frozenset(p.rows for p in products if choices[p] in XLA_PATHS)
            f32_rows = frozenset(p.rows for p in products if choices[p] == XLA_F32)
            return kernels.keep_read_layouts(module, xla_rows, at, f32_rows)

        packed = self._packed(model, rows, keep)
        both = [m for m, _ in _packed_modules(packed, rows) if m.weight is not None and m.plain is not None]
        if both:
            logger.info("%d weights are read by both the kernel and XLA's dot: holding both layouts takes "
                        "%.1f MiB more than one", len(both), sum(m.weight.array.nbytes for m in both) / 2**20)
        return packed

    def _packed(self, model, rows: dict[str, list[int]], keep):
        """`model` with its packable layers packed and fused, each packed module then passed
        through `keep(module, row counts)`, layer by layer (at most one layer's transient copies).
        A layer is packed by one program, the same for every layer; it takes the layer's arrays
        (donated: the model's layers are not used again), so a weight kept in its own layout is
        the same buffer."""
        pack = lambda m: PackedLinear.from_linear(m, self.weight_dtype) if _packable(m) else m  # noqa: E731
        pack_experts = lambda m: (PackedExperts.from_moe_linear(m, self.weight_dtype)  # noqa: E731
                                  if PackedExperts.packable(m) else m)

        @functools.partial(eqx.filter_jit, donate="all")
        def packed_layer(layer):
            layer = jax.tree_util.tree_map(pack_experts, layer, is_leaf=lambda m: isinstance(m, hnn.MoELinear))
            layer = _fuse(jax.tree_util.tree_map(pack, layer, is_leaf=_packable))
            return jax.tree_util.tree_map(lambda m: keep(m, rows["layers"]) if _is_packed(m) else m, layer,
                                          is_leaf=_is_packed)

        layers = model.layers
        if isinstance(layers, tuple):
            layers = tuple(packed_layer(layer) for layer in layers)
        else:
            layers = eqx.tree_at(lambda s: s.stacked, layers, packed_layer(layers.stacked))
        lm_head, Vocab = model.lm_head, model.Vocab
        if lm_head is None and Vocab.size % PANEL == 0:  # tied: unembed with the embedding matrix
            table = model.embeddings.token_embeddings
            if isinstance(table, Int8Embedding):
                lm_head = PackedLinear.from_weight(table.weight, table.Embed, Vocab, None, jnp.int8, table.scale)
            else:
                lm_head = PackedLinear.from_weight(table.weight, table.Embed, Vocab, None, self.weight_dtype)
        elif lm_head is not None:
            lm_head = pack(lm_head)
        if _is_packed(lm_head):
            lm_head = keep(lm_head, rows["lm_head"])
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
                                    window, how.softcap, how.sink_logits())
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

    def adapted(self, x: NamedArray, lora) -> NamedArray:
        """The MLP with each projection's LoRA update (engine.layers.lora.LayerLora): the updates
        join the fused gate/up product's output, so the product and the gating kernel still run."""
        batch, gate_up = self.gate_up.concatenated(x)
        names = [ax.name for ax in batch]
        deltas = [lora.delta(name, x).rearrange((*names, *(ax.name for ax in hax.axis_spec_to_tuple(Out))))
                  for name, Out in zip(("gate_proj", "up_proj"), self.gate_up.Outs)]
        gate_up = gate_up + jnp.concatenate([d.array.reshape(gate_up.shape[0], -1) for d in deltas], axis=-1)
        hidden = unflatten_rows(silu_mul(gate_up), batch, self.gate_up.Outs[0])
        return lora.add("down_proj", self.down_proj(hidden), hidden)


class Bf16BitsKVCache(SplitKVCache):
    """A bfloat16 cache stored as its uint16 bits, which the attention kernel reads as bfloat16:
    XLA's CPU backend widens a bfloat16 scatter to float32 (converting the whole cache twice per
    layer and step), while an integer scatter writes in place."""

    def stored(self, x: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)


WIDEN_MEMORY_SHARE = 0.25
"""At most this share of the host's available memory for one step's widened weights (`xla_f32`)."""


def _widening_fits(modules: list[tuple]) -> bool:
    """Whether a step that widens every weight it may widen (`xla_f32`) to float32 fits in
    `WIDEN_MEMORY_SHARE` of the memory available now. XLA holds a step's widened weights at once
    (it reuses none of their buffers within the step), so that is the step's transient cost."""
    widest = [p for m, at in modules for p in _products(m, [max(at)])]
    wide = sum(4 * p.depth * p.width for p in widest if XLA_F32 in matmul_choice.paths_for(p))
    available = _available_memory()
    if available is None or wide <= WIDEN_MEMORY_SHARE * available:
        return True
    logger.info("XLA's dot in float32 is not considered: a step widening every weight would hold %.2f GiB, more "
                "than %d%% of the %.2f GiB available", wide / 2**30, 100 * WIDEN_MEMORY_SHARE, available / 2**30)
    return False


def _available_memory() -> int | None:
    """Bytes of memory the host can still give (MemAvailable), or None where it does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _is_packed(module) -> bool:
    return isinstance(module, (PackedLinear, FusedLinear))


def _packed_modules(model, rows: dict[str, list[int]]) -> list[tuple]:
    """(packed module, the row counts its products run at) for every packed module of `model`."""
    modules = [(m, rows["layers"]) for m in jax.tree_util.tree_leaves(model.layers, is_leaf=_is_packed)
               if _is_packed(m)]
    return modules + ([(model.lm_head, rows["lm_head"])] if _is_packed(model.lm_head) else [])


def _products(module, rows: list[int]) -> list[Product]:
    """The products `module` runs at `rows` that may run on either path (a float8 weight's run on
    the kernel: none)."""
    if module.group_scales is not None:
        return []
    width = sum(hax.axis_size(Out) for Out in (module.Outs if isinstance(module, FusedLinear) else (module.Out,)))
    dtype = (module.weight if module.weight is not None else module.plain).dtype
    return [Product(r, hax.axis_size(module.In), width, str(dtype)) for r in rows]


def _packable(module) -> bool:
    return isinstance(module, (hnn.Linear, Int8Linear, Fp8Linear)) and PackedLinear.packable(module)


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
