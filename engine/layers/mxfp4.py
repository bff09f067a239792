"""Expert weights in MXFP4 (the OCP microscaling format) as gpt-oss ships them: each block of 32
input values of one output row is 16 bytes of 4-bit floats (e2m1, the low nibble first) and one
byte of power-of-two scale (E8M0: 2 ** (byte - 127)). The bytes stay as they are on the devices (half
a byte a value, 1/32 byte of scale); a product widens the weight it reads (exactly: every e2m1 value
times a power of two is a float32, and a bfloat16 too) to the activations' dtype, as transformers'
dequantization computes it.

Layout: blocks (..., experts, out, in blocks, 16 bytes), scales (..., experts, out, in blocks), the
in-blocks axis named as the input axis (so it splits as the input does: only in whole blocks).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import NamedArray

BLOCK = 32
"""Values per scale."""
BYTES = hax.Axis("mxfp4_bytes", BLOCK // 2)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit code."""


def dequantized(blocks: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """[..., in blocks, 16] bytes and [..., in blocks] scales -> [..., in blocks * 32] values in `dtype`
    (float32 or bfloat16), made in `dtype` from the start: an e2m1 value is exact in either, and so is
    its product with a power of two, whose bits are the scale byte moved into the exponent."""
    codes = jnp.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], BLOCK)
    values = e2m1(codes).astype(dtype)
    return (values * power_of_two(scales, dtype)[..., None]).reshape(*blocks.shape[:-2], -1)


def e2m1(codes: jax.Array) -> jax.Array:
    """The bfloat16 value of each 4-bit code (sign, 2 exponent bits, 1 mantissa bit; exponent 0 is
    0 or 0.5), built from bits elementwise: a table lookup becomes a one-hot product on TPUs, 16
    values wide for every weight."""
    codes = codes.astype(jnp.uint16)
    exponent, mantissa = (codes >> 1) & 3, codes & 1
    normal = ((exponent + 126) << 7) | (mantissa << 6)  # 2 ** (e - 1) * (1 + m / 2)
    bits = jnp.where(exponent > 0, normal, mantissa * (126 << 7)) | ((codes >> 3) << 15)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def power_of_two(scales: jax.Array, dtype) -> jax.Array:
    """2 ** (byte - 127) of E8M0 scale bytes (1..254), in `dtype` (float32 or bfloat16)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(scales.astype(jnp.uint16) << 7, jnp.bfloat16)
    return jax.lax.bitcast_convert_type(scales.astype(jnp.uint32) << 23, jnp.float32).astype(dtype)


class Mxfp4MoELinear(eqx.Module):
    """haliax's `MoELinear` over MXFP4 expert weights; rows come grouped by expert (`group_sizes`, in
    expert order). Biases, where a model has them, are its ExpertMlps' own."""

    blocks: NamedArray
    scales: NamedArray
    Experts: hax.Axis = eqx.field(static=True)
    In: hax.Axis = eqx.field(static=True)
    Out: hax.Axis = eqx.field(static=True)
    use_gmm: bool = eqx.field(static=True, default=False)
    bias = None
    checkpoint_tensors = ("blocks", "scales")

    @staticmethod
    def like(linear: hnn.MoELinear) -> "Mxfp4MoELinear":
        """An (all-zero) MXFP4 layer of `linear`'s axes, to be filled from a checkpoint."""
        if linear.In.size % BLOCK:
            raise ValueError(f"MXFP4 experts need an input size that is a multiple of {BLOCK}; {linear.In.name} is "
                             f"{linear.In.size}")
        lead = tuple(ax for ax in linear.weight.axes if ax not in (linear.In, linear.Out))
        InBlocks = linear.In.resize(linear.In.size // BLOCK)
        return Mxfp4MoELinear(hax.zeros((*lead, linear.Out, InBlocks, BYTES), dtype=jnp.uint8),
                              hax.zeros((*lead, linear.Out, InBlocks), dtype=jnp.uint8), linear.Experts, linear.In,
                              linear.Out, linear.use_gmm)

    def loaded(self, tensors: dict) -> "Mxfp4MoELinear":
        """This layer filled from the checkpoint's `blocks` [..., experts, out, in / 32, 16] and
        `scales` [..., experts, out, in / 32]."""
        return dataclasses.replace(self, blocks=hax.named(jnp.asarray(tensors["blocks"], jnp.uint8), self.blocks.axes),
                                   scales=hax.named(jnp.asarray(tensors["scales"], jnp.uint8), self.scales.axes))

    def weight(self, dtype) -> NamedArray:
        """Every expert's weight (..., experts, in, out) in `dtype`."""
        InBlocks = self.scales.resolve_axis(self.In.name)
        blocks = self.blocks.rearrange((..., self.Out, InBlocks, BYTES))
        scales = self.scales.rearrange((..., self.Out, InBlocks))
        values = dequantized(blocks.array, scales.array, dtype)
        return hax.named(values, (*blocks.axes[:-2], self.In)).rearrange((..., self.Experts, self.In, self.Out))

    def __call__(self, inputs: NamedArray, group_sizes: NamedArray, *, key=None) -> NamedArray:
        del key
        widened = hnn.MoELinear(self.weight(inputs.dtype), None, self.Experts, self.In, self.Out,
                                use_gmm=self.use_gmm)
        return widened(inputs, group_sizes)

    def expert_product(self, expert: jax.Array, rows: jax.Array) -> jax.Array:
        """rows f[R, In] @ expert `expert`'s weight, in float32 (its weight alone widened)."""
        InBlocks = self.scales.resolve_axis(self.In.name)
        blocks = self.blocks.rearrange((self.Experts, self.Out, InBlocks, BYTES)).array[expert]
        scales = self.scales.rearrange((self.Experts, self.Out, InBlocks)).array[expert]
        return rows.astype(jnp.float32) @ dequantized(blocks, scales, jnp.float32).T
