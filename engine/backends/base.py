"""The interface every attention backend implements.

A backend owns these, and nothing outside it asks which backend runs:
- the KV cache: its layout, its storage dtype, its initialisation and its sharding by KV head;
- the cache write and attention over one step's tokens (`attend`, once per layer), in the one
  token layout every backend reads (rows packed, see engine.step.buckets), and any per-step tables
  it precomputes (`begin_step`);
- weight preparation (`prepare`), the q/k/v projection (`project_qkv`), the activation dtype and
  greedy argmax, for backends with their own kernels;
- the layer loop it runs by default (`scan_layers`) and the tokens a step holds at about the cost
  of one (`flat_step_tokens`).

Attention is over named arrays: q (position, kv_head, q_heads_per_group, head_size), k and v
(position, kv_head, head_size); the result has q's axes. A layer's `LayerAttention` says how its
scores are made: scaled, soft-capped, over a sliding window of keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import jax
import jax.numpy as jnp
from haliax import NamedArray
from jax.sharding import Mesh, PartitionSpec

from engine.step.buckets import SMALLEST_BATCH, ShapeBuckets
from engine.step.plan import StepInputs

Q_AXES = ("position", "kv_head", "q_heads_per_group", "head_size")
KV_AXES = ("position", "kv_head", "head_size")


@dataclasses.dataclass(frozen=True)
class CacheShape:
    """The sizes of one replica's KV pool (all of it; sharding splits `kv_heads`)."""

    num_layers: int
    num_pages: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: Any
    """The dtype of the values (float32 or bfloat16); a backend may store them otherwise."""
    values_are_keys: bool = False
    """Each token's value is its key (latent attention's cached latent): the pool stores the keys
    only, `attend` gets k and v the same and reads both from the one array."""

    @property
    def arrays(self) -> int:
        """Arrays of `head_dim` a token and layer the pool stores: keys and values, or keys alone."""
        return 1 if self.values_are_keys else 2


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """How one layer attends: scores = scale * q . k, then cap * tanh(scores / cap) with a soft-cap,
    then a query at position i sees the keys at i - window < j <= i where the layer slides (all
    keys j <= i otherwise). With sinks, query head h = kv_head * G + g has a learned logit
    sinks[kv_head, g] in its softmax's denominator and no value: p_j = exp(s_j - m) /
    (sum_j exp(s_j - m) + exp(sinks - m)), m = max(max_j s_j, sinks) (gpt-oss)."""

    scale: float
    softcap: Optional[float] = None
    window: Optional[int] = None
    """The model's sliding window (static); None: no layer of the model slides."""
    slides: Any = False
    """Whether this layer slides: a bool, or a traced bool in a scanned layer loop."""
    sinks: Any = None
    """None (no sinks), or the layer's sink logits: a NamedArray f32 ("kv_head", "q_heads_per_group"),
    traced in a scanned layer loop, split on kv_head as q is under tensor parallelism."""

    def sink_logits(self) -> Optional[jax.Array]:
        """The sinks as f32[kv_head, q_heads_per_group], or None."""
        if self.sinks is None:
            return None
        return self.sinks.rearrange(("kv_head", "q_heads_per_group")).array.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class AttentionStep:
    """What every layer's attention of one step reads: the step's arrays and the tables a backend
    precomputed once for all layers (`begin_step`)."""

    inputs: StepInputs
    tables: Any = None


class AttentionBackend:
    name: ClassVar[str]
    shardable: ClassVar[bool] = True
    """Whether it runs with tensor parallelism (its ops partition over a mesh)."""
    scan_layers: bool = True
    """The layer loop it runs unless `scan_layers` is configured: scanned (compile time independent
    of depth) where that costs no speed (engine.models.paged_model)."""
    platform: str
    """The platform of the devices it runs on (`platform_of` the mesh): "cpu", "tpu", "gpu"."""

    def prepare(self, model, buckets: ShapeBuckets, measure: bool):
        """The serving model with weights laid out for this backend (engine.models.paged_model),
        for steps of `buckets`' shapes; `measure`: time what depends on the machine (at warm-up)."""
        return model

    def activation_dtype(self, weight_dtype) -> jnp.dtype:
        return jnp.dtype(weight_dtype)

    def init_cache(self, shape: CacheShape):
        """The empty KV cache (a pytree of arrays)."""
        raise NotImplementedError

    def cache_partition(self, model_axis: str) -> PartitionSpec:
        """The PartitionSpec of every array of the cache: KV heads split on `model_axis`."""
        raise NotImplementedError

    def cache_bytes_per_page(self, shape: CacheShape) -> int:
        """Bytes one page takes over all layers, all KV heads (keys and values, or keys alone)."""
        itemsize = jnp.dtype(self.storage_dtype(shape.dtype)).itemsize
        return shape.num_layers * shape.page_size * shape.kv_heads * shape.head_dim * shape.arrays * itemsize

    def storage_dtype(self, dtype) -> jnp.dtype:
        return jnp.dtype(dtype)

    def project_qkv(self, attn, h: NamedArray) -> tuple[NamedArray, NamedArray, NamedArray]:
        """q, k and v of a levanter attention module over the hidden states `h` (before rotary
        embeddings and norms); a backend that fused the projections in `prepare` runs them here."""
        return attn.q_proj(h, key=None), attn.k_proj(h, key=None), attn.v_proj(h, key=None)

    def begin_step(self, inputs: StepInputs) -> AttentionStep:
        return AttentionStep(inputs)

    def attend(self, cache, layer, q: NamedArray, k: NamedArray, v: NamedArray, how: LayerAttention,
               step: AttentionStep) -> tuple[NamedArray, Any]:
        """Write the step's keys and values into layer `layer` of the cache, then attend as `how`
        says; returns (attention output with q's axes, updated cache)."""
        raise NotImplementedError

    def flat_step_tokens(self, step_budget: int) -> int:
        """Tokens a step holds at about the cost of one, of `step_budget` at most: on CPUs the
        smallest multi-token bucket (a matmul's cost grows with its rows past a handful), elsewhere
        the whole budget (a step reads every weight once, whatever its rows, until far more tokens
        than a decode batch)."""
        if self.platform == "cpu":
            return min(SMALLEST_BATCH, step_budget)
        return step_budget

    @staticmethod
    def argmax(logits: jax.Array) -> jax.Array:
        """Greedy tokens i32[R] of logits f32[R, V] (the first maximum, as jnp.argmax)."""
        return jnp.argmax(logits, axis=-1)


def platform_of(mesh: Mesh) -> str:
    """The platform of `mesh`'s devices ("cpu", "tpu", "gpu"): what every backend decision reads (the
    mesh's devices, never the process's default backend)."""
    return mesh.devices.flat[0].platform


def visible_tokens(inputs: StepInputs) -> jax.Array:
    """i32[T]: how many of its sequence's tokens each token attends to (itself and every one
    before it), 0 for padding. Padding sits after the last row's tokens, where the last row (a
    padding row when there is one) ends: q_start[-1] + q_lens[-1]."""
    end = inputs.q_start[-1] + inputs.q_lens[-1]
    return jnp.where(jnp.arange(inputs.tokens.shape[0]) < end, inputs.positions + 1, 0)
