"""A mixture of experts' stacked weights for the cpu kernels: every expert's weight in the matmul
kernel's panel layout, one stack (experts, panel, in, lane), and each grouped product one kernel
call (`grouped_matmul`) that reads each chosen expert's panels once for all its rows, widening
bfloat16 in registers. XLA on CPUs runs a grouped product (jax.lax.ragged_dot) as a product over
every expert, and widens a bfloat16 weight whole before any product.

With packed experts a MoE dispatches its rows grouped (engine.layers.moe.dispatch), not tile by tile.
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax.numpy as jnp
from haliax import NamedArray

from engine.backends.cpu.kernels import PANEL, grouped_matmul, matmul, pack


class PackedExperts(eqx.Module):
    """A drop-in for haliax's `MoELinear` (`__call__(rows, group_sizes)`, same axes), float32 output."""

    weight: NamedArray
    """dtype[experts, panel = Out / 16, in, lane = 16]"""
    bias: NamedArray | None
    Experts: hax.Axis = eqx.field(static=True)
    In: hax.Axis = eqx.field(static=True)
    Out: hax.Axis = eqx.field(static=True)
    runs_grouped: ClassVar[bool] = True
    """Its grouped product is the fast one on this platform (engine.layers.moe.for_platform)."""

    @staticmethod
    def packable(linear) -> bool:
        """A float grouped product (not a quantized one) whose output splits into whole panels."""
        return (type(linear) is hnn.MoELinear and linear.Out.size % PANEL == 0
                and linear.weight.dtype in (jnp.float32, jnp.bfloat16))

    @staticmethod
    def from_moe_linear(linear: hnn.MoELinear, dtype) -> "PackedExperts":
        weight = linear.weight.rearrange((linear.Experts, linear.In, linear.Out)).array
        packed = hax.named(pack(weight, dtype), (linear.Experts.name, "panel", linear.In.name, "lane"))
        return PackedExperts(packed, linear.bias, linear.Experts, linear.In, linear.Out)

    def __call__(self, rows: NamedArray, group_sizes: NamedArray, *, key=None) -> NamedArray:
        """rows (expert_rows, in) grouped by expert -> (expert_rows, out)."""
        del key
        (Rows,) = (axis for axis in rows.axes if axis != self.In)
        out = grouped_matmul(rows.rearrange((Rows, self.In)).array, self.weight.array,
                             group_sizes.rearrange((self.Experts,)).array)
        out = hax.named(out, (Rows, self.Out))
        return out if self.bias is None else out + self.bias

    def expert_product(self, expert, rows):
        """rows f[R, in] @ expert `expert`'s weight -> f32[R, out] (a MoE run tile by tile, whose other
        projections could not be packed); the kernel reads the expert's panels from the stack."""
        return matmul(rows, self.weight.array, layer=expert)
