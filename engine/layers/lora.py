"""LoRA on the devices: `max_loras` adapters resident at once, each token of a step adapted by its
own row's adapter while the base weights are shared.

The pool (`LoraPool`) holds, per adaptable projection, every layer's factors of every slot:
a (layer, adapter, *In, lora_rank) and b (layer, adapter, lora_rank, *Out), the adapter's scale
folded into b. A slot no adapter holds, and a projection an adapter does not adapt, are zeros;
ranks below the pool's are zero-padded (the product is unchanged).

A projection's update for the step's tokens x (position, *In) is computed for every slot and kept
for each token's own: ((x . a) * onehot) . b, contracting (adapter, lora_rank) at once, where
onehot (position, adapter) is 1 at the token's row's slot (all zero for the base model). Its cost
is a rank-(max_loras * rank) product beside the base projection, whatever mix of adapters the step
holds.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray

from engine.formats.peft import TARGETS, LoraAdapter

ADAPTER, RANK, LAYER = "adapter", "lora_rank", "lora_layer"


@dataclasses.dataclass(frozen=True)
class LoraShape:
    """The pool's sizes: the axes (In, Out) of each adaptable projection of the serving model."""

    projections: dict[str, tuple[tuple[hax.Axis, ...], tuple[hax.Axis, ...]]]
    num_layers: int
    slots: int
    rank: int

    @staticmethod
    def of(layer, num_layers: int, slots: int, rank: int) -> "LoraShape":
        """The projections of one levanter decoder layer that adapters may adapt: the attention's,
        and a gated MLP's (gate, up, down); a mixture of experts' are not."""
        modules = {name: getattr(layer.self_attn, name) for name in TARGETS[:4]}
        mlp = getattr(layer, "mlp", None)
        if all(hasattr(getattr(mlp, name, None), "Out") for name in TARGETS[4:]):
            modules.update({name: getattr(mlp, name) for name in TARGETS[4:]})
        axes = lambda spec: tuple(hax.axis_spec_to_tuple(spec))  # noqa: E731
        return LoraShape({name: (axes(m.In), axes(m.Out)) for name, m in modules.items()}, num_layers, slots, rank)


class LoraPool(eqx.Module):
    """Every slot's factors, by projection name (see the module docstring)."""

    a: dict[str, NamedArray]
    b: dict[str, NamedArray]

    @staticmethod
    def zeros(shape: LoraShape, dtype) -> "LoraPool":
        Layer, Slot = hax.Axis(LAYER, shape.num_layers), hax.Axis(ADAPTER, shape.slots)
        Rank = hax.Axis(RANK, shape.rank)
        a = {name: hax.zeros((Layer, Slot, *In, Rank), dtype) for name, (In, _) in shape.projections.items()}
        b = {name: hax.zeros((Layer, Slot, Rank, *Out), dtype) for name, (_, Out) in shape.projections.items()}
        return LoraPool(a, b)

    def onehot(self, token_slot: NamedArray) -> NamedArray:
        """(position, adapter): 1 at each token's slot, given `token_slot` (position; -1: the base
        model, all zero). Made once per step; every layer reads it."""
        Slot = next(iter(self.a.values())).resolve_axis(ADAPTER)
        return (token_slot.broadcast_axis(Slot) == hax.arange(Slot)).astype(jnp.float32)

    def for_step(self, layer, onehot: NamedArray) -> "LayerLora":
        """Layer `layer`'s factors (an int, or traced in a scanned loop) for the step's tokens,
        each reading its slot of `onehot` (see `onehot`)."""
        pick = lambda arrays: {name: x[LAYER, layer] for name, x in arrays.items()}  # noqa: E731
        return LayerLora(pick(self.a), pick(self.b), onehot)


class LayerLora(eqx.Module):
    """One layer's factors of every slot, and which slot each of the step's tokens reads."""

    a: dict[str, NamedArray]
    b: dict[str, NamedArray]
    onehot: NamedArray  # (position, adapter)

    def adapts(self, name: str) -> bool:
        return name in self.a

    def delta(self, name: str, x: NamedArray) -> NamedArray:
        """The update to projection `name`'s output for inputs x (position, *In)."""
        a, b = self.a[name], self.b[name]
        In = tuple(ax.name for ax in a.axes if ax.name not in (ADAPTER, RANK))
        h = hax.dot(x, a, axis=In, preferred_element_type=jnp.float32) * self.onehot
        return hax.dot(h, b, axis=(ADAPTER, RANK), preferred_element_type=jnp.float32).astype(x.dtype)

    def add(self, name: str, y: NamedArray, x: NamedArray) -> NamedArray:
        """y (the projection of x) plus its update, where adapters adapt `name`."""
        return y + self.delta(name, x).astype(y.dtype) if self.adapts(name) else y


def slot_arrays(adapter: LoraAdapter, shape: LoraShape, num_kv_heads: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """One slot's (a, b) per projection as host arrays of the pool's layout without the adapter
    axis: a (layer, *In, lora_rank), b (layer, lora_rank, *Out); zeros where `adapter` does not
    adapt. KV heads the serving model repeats (tensor parallelism) are repeated in k and v's b; a
    query projection's heads regroup in the same flat order."""
    out = {}
    for name, (In, Out) in shape.projections.items():
        sizes_in, sizes_out = [ax.size for ax in In], [ax.size for ax in Out]
        a = np.zeros((shape.num_layers, *sizes_in, shape.rank), np.float32)
        b = np.zeros((shape.num_layers, shape.rank, *sizes_out), np.float32)
        for layer in range(shape.num_layers):
            factors = adapter.factors.get((layer, name))
            if factors is None:
                continue
            rank = factors.a.shape[0]
            a[layer, ..., :rank] = factors.a.T.reshape(*sizes_in, rank)
            b[layer, :rank] = _serving_out(factors.b.T, name, sizes_out, num_kv_heads)
        out[name] = (a, b)
    return out


def _serving_out(b: np.ndarray, name: str, sizes_out: list[int], num_kv_heads: int) -> np.ndarray:
    """b (rank, out) laid out as the serving model's output axes."""
    rank = b.shape[0]
    if name in ("k_proj", "v_proj") and sizes_out[0] != num_kv_heads:  # KV heads repeated
        b = np.repeat(b.reshape(rank, num_kv_heads, -1), sizes_out[0] // num_kv_heads, axis=1)
    return b.reshape(rank, *sizes_out)


def load_slot(pool: LoraPool, slot: jax.Array, arrays: dict[str, tuple[jax.Array, jax.Array]]) -> LoraPool:
    """`pool` with slot `slot` holding `arrays` (slot_arrays' layout); jit it with the pool donated."""
    def put(x: NamedArray, value: jax.Array) -> NamedArray:
        index = x.axes.index(x.resolve_axis(ADAPTER))
        starts = [0] * x.array.ndim
        starts[index] = slot
        update = jnp.expand_dims(value.astype(x.dtype), index)
        return hax.named(jax.lax.dynamic_update_slice(x.array, update, starts), x.axes)

    return LoraPool({n: put(x, arrays[n][0]) for n, x in pool.a.items()},
                    {n: put(x, arrays[n][1]) for n, x in pool.b.items()})
