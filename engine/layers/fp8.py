"""Linear layers over FP8 weights as checkpoints ship them (engine.formats.checkpoint_quantization):
the weight's bytes stay float8 e4m3 on the devices, its float32 scales beside it, and a product
widens the weight (exactly: an e4m3 value times its float32 scale is rounded once, as transformers'
dequantization rounds it) to the activations' dtype and sums in float32.

The modules keep the named axes of the ones they replace (haliax's `Linear`, `MoELinear`, laid
out inputs first), so tensor parallelism, repeated KV heads and scanned layers treat them as any
weight. A checkpoint scales blocks of the flattened (out, in) matrix; here the scales are named as
the weight is, every axis whole but the innermost of `In` and of `Out`, which has one entry per
`f` values: f divides the block size (so each entry lies in one block, and reading the checkpoint's
blocks at that granularity is exact), the axis (so entries never straddle its rows), and the
axis's share on one device (so a device holds the scales of its own part). For a block of 128 the
scales take 1/32 of the weight's bytes or less.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray
from haliax.state_dict import with_prefix

from engine.formats.checkpoint_quantization import CheckpointQuantization

FP8 = jnp.dtype(jnp.float8_e4m3fn)


def scale_axes(axes: tuple[hax.Axis, ...], block: int, parts: Optional[dict[str, int]] = None) -> tuple[hax.Axis, ...]:
    """The scales' axes for a weight's `axes` (its In or its Out) scaled in blocks of `block`
    flattened values (0: all of them), as the module docstring says; `parts`: how many parts the
    serving layout may split each axis into (by name; absent: 1)."""
    *outer, inner = axes
    block = block or math.prod(ax.size for ax in axes)
    f = math.gcd(block, inner.size, inner.size // (parts or {}).get(inner.name, 1))
    return (*outer, inner.resize(inner.size // f))


def _block_index(axes: tuple[hax.Axis, ...], scaled: tuple[hax.Axis, ...], block: int) -> np.ndarray:
    """For each scale entry over `scaled` (flattened), the checkpoint's block along `axes` it lies in."""
    full = math.prod(ax.size for ax in axes)
    f = axes[-1].size // scaled[-1].size
    starts = np.arange(full).reshape(-1, axes[-1].size)[:, ::f].reshape(-1)
    return starts // (block or full)


def dequantized(weight: NamedArray, scale: NamedArray, dtype) -> NamedArray:
    """weight * scale (each scale entry repeated over the values it scales) in `dtype`."""
    return (weight.astype(jnp.float32) * repeated(scale, weight.axes)).astype(dtype)


def repeated(scale: NamedArray, axes: tuple[hax.Axis, ...]) -> NamedArray:
    """`scale` with each of its axes that `axes` names at a larger size repeated to that size."""
    sizes = {ax.name: ax.size for ax in axes}
    for index, ax in enumerate(scale.axes):
        size = sizes.get(ax.name, ax.size)
        if size != ax.size:
            scale = hax.named(jnp.repeat(scale.array, size // ax.size, axis=index),
                              scale.axes[:index] + (ax.resize(size),) + scale.axes[index + 1:])
    return scale


def from_checkpoint(weight: jax.Array, scale: jax.Array, lead: tuple[hax.Axis, ...], In: tuple[hax.Axis, ...],
                     Out: tuple[hax.Axis, ...], Scaled: tuple[tuple, tuple], block: tuple[int, int]):
    """(weight (lead, *In, *Out), scale (lead, *In', *Out')) of a checkpoint's weight [..., out, in]
    (float8) and its scales [..., out blocks, in blocks] (or fewer dimensions for one scale)."""
    ScaledIn, ScaledOut = Scaled
    sizes = lambda axes: tuple(ax.size for ax in axes)  # noqa: E731
    w = hax.named(jnp.asarray(weight).reshape(*sizes(lead), *sizes(Out), *sizes(In)), (*lead, *Out, *In))
    blocks = [-(-math.prod(sizes(axes)) // b) if b else 1 for axes, b in ((Out, block[0]), (In, block[1]))]
    s = jnp.asarray(scale, jnp.float32).reshape(*sizes(lead), *blocks)
    s = jnp.take(s, _block_index(Out, ScaledOut, block[0]), axis=-2)
    s = jnp.take(s, _block_index(In, ScaledIn, block[1]), axis=-1)
    s = hax.named(s.reshape(*sizes(lead), *sizes(ScaledOut), *sizes(ScaledIn)), (*lead, *ScaledOut, *ScaledIn))
    return w.rearrange((..., *In, *Out)).astype(FP8), s.rearrange((..., *ScaledIn, *ScaledOut))


class Fp8Linear(eqx.Module):
    """haliax's `Linear` over a float8 weight (..., *In, *Out) and float32 scales (..., *In', *Out')."""

    weight: NamedArray
    scale: NamedArray
    bias: NamedArray | None
    In: tuple[hax.Axis, ...] = eqx.field(static=True)
    Out: tuple[hax.Axis, ...] = eqx.field(static=True)
    block: tuple[int, int] = eqx.field(static=True)
    """The checkpoint's (output rows, input columns) per scale, 0 for a whole dimension."""
    scale_name: str = eqx.field(static=True)

    @staticmethod
    def like(linear: hnn.Linear, quantization: CheckpointQuantization,
             parts: Optional[dict[str, int]] = None) -> "Fp8Linear":
        """An (all-zero) FP8 linear layer of `linear`'s axes, to be filled from a checkpoint
        (`parts`: `scale_axes`')."""
        In, Out = hax.axis_spec_to_tuple(linear.In), hax.axis_spec_to_tuple(linear.Out)
        lead = tuple(ax for ax in linear.weight.axes if ax not in In + Out)
        scale = hax.zeros((*lead, *scale_axes(In, quantization.block[1], parts),
                           *scale_axes(Out, quantization.block[0], parts)))
        return Fp8Linear(hax.zeros((*lead, *In, *Out), dtype=FP8), scale, linear.bias, In, Out, quantization.block,
                         quantization.scale_name)

    def __call__(self, inputs: NamedArray, *, key=None) -> NamedArray:
        del key
        weight = dequantized(self.weight, self.scale, inputs.dtype)
        out = hax.dot(inputs, weight, axis=self.In, preferred_element_type=jnp.float32).astype(inputs.dtype)
        return out if self.bias is None else out + self.bias

    def column_scales(self) -> jax.Array:
        """f32[..., K / G, N]: the scale of every output column (flattened Out, N of them) for each
        group of G flattened input rows (K of them), as engine.backends.cpu's kernel reads them."""
        ScaledIn, _ = self.scaled_axes()
        lead = tuple(ax for ax in self.weight.axes if ax not in self.In + self.Out)
        columns = repeated(self.scale, self.Out).rearrange((*lead, *ScaledIn, *self.Out)).array
        groups = math.prod(ax.size for ax in ScaledIn)
        return columns.reshape(*(ax.size for ax in lead), groups, hax.axis_size(self.Out))

    def scaled_axes(self) -> tuple[tuple, tuple]:
        return (tuple(self.scale.resolve_axis(ax.name) for ax in self.In),
                tuple(self.scale.resolve_axis(ax.name) for ax in self.Out))

    def from_state_dict(self, state_dict: dict, prefix: str | None = None) -> "Fp8Linear":
        lead = tuple(ax for ax in self.weight.axes if ax not in self.In + self.Out)
        weight, scale = from_checkpoint(state_dict[with_prefix(prefix, "weight")],
                                         state_dict[with_prefix(prefix, self.scale_name)], lead, self.In, self.Out,
                                         self.scaled_axes(), self.block)
        bias = self.bias
        if bias is not None:
            bias = hax.named(jnp.asarray(state_dict[with_prefix(prefix, "bias")]).reshape(bias.array.shape), bias.axes)
        return dataclasses.replace(self, weight=weight, scale=scale, bias=bias)


class Fp8MoELinear(eqx.Module):
    """haliax's `MoELinear` over float8 expert weights (..., Experts, In, Out) and float32 scales
    (..., Experts, In', Out'); rows come grouped by expert (`group_sizes`, in expert order)."""

    weight: NamedArray
    scale: NamedArray
    bias: NamedArray | None
    Experts: hax.Axis = eqx.field(static=True)
    In: hax.Axis = eqx.field(static=True)
    Out: hax.Axis = eqx.field(static=True)
    use_gmm: bool = eqx.field(static=True)
    block: tuple[int, int] = eqx.field(static=True)
    scale_name: str = eqx.field(static=True)

    @staticmethod
    def like(linear: hnn.MoELinear, quantization: CheckpointQuantization,
             parts: Optional[dict[str, int]] = None) -> "Fp8MoELinear":
        lead = tuple(ax for ax in linear.weight.axes if ax not in (linear.In, linear.Out))
        scale = hax.zeros((*lead, *scale_axes((linear.In,), quantization.block[1], parts),
                           *scale_axes((linear.Out,), quantization.block[0], parts)))
        return Fp8MoELinear(hax.zeros((*lead, linear.In, linear.Out), dtype=FP8), scale, linear.bias, linear.Experts,
                            linear.In, linear.Out, linear.use_gmm, quantization.block, quantization.scale_name)

    def __call__(self, inputs: NamedArray, group_sizes: NamedArray, *, key=None) -> NamedArray:
        del key
        weight = dequantized(self.weight, self.scale, inputs.dtype)
        return hnn.MoELinear(weight, self.bias, self.Experts, self.In, self.Out, use_gmm=self.use_gmm)(inputs,
                                                                                                       group_sizes)

    def expert_product(self, expert: jax.Array, rows: jax.Array) -> jax.Array:
        """rows f[R, In] @ expert `expert`'s weight, in float32 (its weight alone widened)."""
        def of_expert(array: NamedArray, In: hax.Axis, Out: hax.Axis) -> NamedArray:
            return hax.named(array.rearrange((self.Experts, In, Out)).array[expert], (In, Out))

        scaled = (self.scale.resolve_axis(self.In.name), self.scale.resolve_axis(self.Out.name))
        one = dequantized(of_expert(self.weight, self.In, self.Out), of_expert(self.scale, *scaled), jnp.float32)
        return rows.astype(jnp.float32) @ one.rearrange((self.In, self.Out)).array

    @property
    def checkpoint_tensors(self) -> tuple[str, str]:
        return "weight", self.scale_name

    def loaded(self, tensors: dict) -> "Fp8MoELinear":
        """This layer filled from the checkpoint's stacked expert weights [..., experts, out, in] and
        their scales [..., experts, out blocks, in blocks] (`checkpoint_tensors` names them)."""
        lead = tuple(ax for ax in self.weight.axes if ax not in (self.In, self.Out))
        Scaled = ((self.scale.resolve_axis(self.In.name),), (self.scale.resolve_axis(self.Out.name),))
        weight, scale = from_checkpoint(tensors["weight"], tensors[self.scale_name], lead, (self.In,), (self.Out,),
                                        Scaled, self.block)
        return dataclasses.replace(self, weight=weight, scale=scale)


def is_fp8(module) -> bool:
    return isinstance(module, (Fp8Linear, Fp8MoELinear))


def dequantize_host(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """A checkpoint's FP8 weight [out, in] times its scales, as a float32 array (on the host): for
    the few FP8 weights served in float (a router)."""
    out, cols = weight.shape
    blocks = [block[0] or out, block[1] or cols]
    s = np.asarray(scale, np.float32).reshape(-(-out // blocks[0]), -(-cols // blocks[1]))
    s = np.repeat(np.repeat(s, blocks[0], axis=0)[:out], blocks[1], axis=1)[:, :cols]
    return weight.astype(np.float32) * s
