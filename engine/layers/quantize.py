"""Weight-only int8 quantization, made at load time from a checkpoint's float weights.

Every linear layer's weight becomes int8 with one float32 scale per output channel (symmetric: scale
= max |w| over the inputs / 127), each expert of a mixture of experts with its own scales, and the
token embedding int8 with one scale per vocabulary row, which serves both the lookup and a tied LM
head (a row of the embedding is an output channel of the unembedding). A router (which picks a
token's experts) and its correction bias keep their float weights: a flipped choice costs more than
their few bytes save; a mixture's shared MLP is quantized as a dense one.
Activations, norms, biases and the KV cache keep their dtype; a product converts the int8 weight to
the activations' dtype (exact: |q| <= 127 fits bfloat16's mantissa), sums in float32 and scales its
output before rounding it to the activations' dtype once. Weight memory and the bytes a decode step
streams are about half of bfloat16's.

The modules keep the axes of the ones they replace (haliax's `Linear`, `MoELinear`, `Embedding`), so
sharding, scanned layers and the backends treat them as any weight; the cpu backend packs them for
its int8 kernel (engine.backends.cpu.kernels).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import NamedArray

from engine.layers.fp8 import is_fp8
from engine.layers.moe import MoE

QUANTIZATIONS = ("int8",)


class Int8Linear(eqx.Module):
    """haliax's `Linear` over an int8 weight (..., In, Out) and float32 scales (..., Out)."""

    weight: NamedArray
    scale: NamedArray
    bias: NamedArray | None
    In: tuple[hax.Axis, ...] = eqx.field(static=True)
    Out: tuple[hax.Axis, ...] = eqx.field(static=True)

    @staticmethod
    def from_linear(linear: hnn.Linear) -> "Int8Linear":
        In, Out = hax.axis_spec_to_tuple(linear.In), hax.axis_spec_to_tuple(linear.Out)
        weight, scale = quantize(linear.weight * linear.reparam.active_scale, In)
        return Int8Linear(weight, scale, linear.bias, In, Out)

    def __call__(self, inputs: NamedArray, *, key=None) -> NamedArray:
        del key
        out = hax.dot(inputs, self.weight.astype(inputs.dtype), axis=self.In, preferred_element_type=jnp.float32)
        out = (out * self.scale).astype(inputs.dtype)
        return out if self.bias is None else out + self.bias


class Int8MoELinear(eqx.Module):
    """haliax's `MoELinear` over int8 expert weights (Experts, ..., In, Out) and float32 scales
    (Experts, Out). Its rows come grouped by expert (`group_sizes`, in expert order); each row's
    output is scaled by its own expert's scales. haliax's grouped product rounds to the
    activations' dtype before the scales apply (one rounding more than `Int8Linear`'s)."""

    weight: NamedArray
    scale: NamedArray
    bias: NamedArray | None
    Experts: hax.Axis = eqx.field(static=True)
    In: hax.Axis = eqx.field(static=True)
    Out: hax.Axis = eqx.field(static=True)
    use_gmm: bool = eqx.field(static=True)

    @staticmethod
    def from_moe_linear(linear: hnn.MoELinear) -> "Int8MoELinear":
        weight, scale = quantize(linear.weight, linear.In)
        return Int8MoELinear(weight, scale.rearrange((..., linear.Experts, linear.Out)), linear.bias, linear.Experts,
                             linear.In, linear.Out, linear.use_gmm)

    def expert_product(self, expert: jax.Array, rows: jax.Array) -> jax.Array:
        """rows f[R, In] @ expert `expert`'s weight, in float32, scaled by its own scales."""
        weight = self.weight.rearrange((self.Experts, self.In, self.Out)).array[expert]
        out = rows.astype(jnp.float32) @ weight.astype(jnp.float32)
        return out * self.scale.rearrange((self.Experts, self.Out)).array[expert]

    def __call__(self, inputs: NamedArray, group_sizes: NamedArray, *, key=None) -> NamedArray:
        del key
        widened = hnn.MoELinear(self.weight.astype(inputs.dtype), None, self.Experts, self.In, self.Out,
                                use_gmm=self.use_gmm)
        out = widened(inputs, group_sizes)
        Rows = out.resolve_axis(hax.axis.without_axes(out.axes, self.Out)[0].name)
        expert = jnp.repeat(jnp.arange(self.Experts.size), group_sizes.array, total_repeat_length=Rows.size)
        scale = hax.named(self.scale.rearrange((self.Experts, self.Out)).array[expert], (Rows, self.Out))
        out = (out.astype(jnp.float32) * scale).astype(inputs.dtype)
        return out if self.bias is None else out + self.bias


class Int8Embedding(eqx.Module):
    """haliax's `Embedding` over an int8 table (Vocab, Embed) with a float32 scale per row; rows
    come out in `dtype` (the checkpoint's)."""

    weight: NamedArray
    scale: NamedArray
    Vocab: hax.Axis = eqx.field(static=True)
    Embed: hax.Axis = eqx.field(static=True)
    dtype: jnp.dtype = eqx.field(static=True)

    @staticmethod
    def from_embedding(embedding: hnn.Embedding) -> "Int8Embedding":
        table = embedding.weight * embedding.reparam.active_scale
        weight, scale = quantize(table, embedding.Embed)
        return Int8Embedding(weight, scale, embedding.Vocab, embedding.Embed, jnp.dtype(embedding.weight.dtype))

    def __call__(self, input_ids: NamedArray) -> NamedArray:
        return self.embed(input_ids)

    def embed(self, input_ids: NamedArray) -> NamedArray:
        rows = self.weight.take(self.Vocab, input_ids) * self.scale.take(self.Vocab, input_ids)
        return rows.astype(self.dtype)

    def unembed(self, x: NamedArray) -> NamedArray:
        logits = hax.dot(x, self.weight.astype(x.dtype), axis=self.Embed, preferred_element_type=jnp.float32)
        return (logits * self.scale).astype(x.dtype)


def quantize(weight: NamedArray, In) -> tuple[NamedArray, NamedArray]:
    """(int8 weight, float32 scale over the non-`In` axes): symmetric, per output channel."""
    w = weight.astype(jnp.float32)
    scale = hax.max(hax.abs(w), axis=In) / 127.0
    scale = hax.where(scale > 0, scale, 1.0)  # an all-zero channel stays zero
    q = hax.clip(hax.round(w / scale), -127, 127).astype(jnp.int8)
    return q, scale


def _quantize_modules(tree):
    """`tree` with every linear layer and mixture of experts quantized, routers kept as they are."""
    def quantized(module):
        if isinstance(module, hnn.Linear):
            return Int8Linear.from_linear(module)
        if isinstance(module, hnn.MoELinear):
            return Int8MoELinear.from_moe_linear(module)
        if isinstance(module, MoE):  # its router (`gate`) and correction bias keep their float weights
            return dataclasses.replace(module, experts=_quantize_modules(module.experts),
                                       shared=_quantize_modules(module.shared))
        return module

    return jax.tree_util.tree_map(quantized, tree, is_leaf=lambda m: isinstance(m, (hnn.Linear, hnn.MoELinear, MoE)))


def quantize_model(model, quantization: str | None):
    """`model` (levanter's LM-head model) with its linear layers and token embedding quantized as
    `quantization` says (None: unchanged)."""
    if quantization is None:
        return model
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported; use one of {QUANTIZATIONS} or none")
    if any(is_fp8(m) for m in jax.tree_util.tree_leaves(model, is_leaf=is_fp8)):
        raise ValueError(f"quantization {quantization!r} quantizes a checkpoint's float weights, and this "
                         "checkpoint's are FP8 already: serve it without `quantization`")
    model = _quantize_modules(model)
    embeddings = model.embeddings
    if isinstance(getattr(embeddings, "token_embeddings", None), hnn.Embedding):
        quantized = Int8Embedding.from_embedding(embeddings.token_embeddings)
        model = dataclasses.replace(model, embeddings=dataclasses.replace(embeddings, token_embeddings=quantized))
    return model
