"""Tensor parallelism: a replica's device mesh, and how the model's named axes split over it.

The devices of a replica form a ("data", "model") mesh of 1 x `tensor_parallel_size`. Through
haliax's axis mapping, attention heads (`heads`, and `kv_head` of q/k/v), the MLP (`mlp`) and the
vocabulary (`vocab`: the embedding and the LM head) are split on "model"; norms and the residual
stream are replicated. A mixture of experts splits either each expert's MLP (`expert_mlp`, as a
dense MLP) or the experts themselves (`experts`: expert parallelism, engine.layers.moe), each
device then holding whole experts. Every device then attends with its own heads over its own share of the KV
cache (split by KV head), and XLA adds the collectives: an all-reduce after o_proj and down_proj,
a gather of the logits before sampling, so sampled tokens and logprobs come back replicated.

With fewer KV heads than devices, each KV head is repeated until there is one per device (as
tpu-inference and sglang-jax do): head h of the original serves the query heads h * G .. (h+1) * G
- 1; after repeating it r times, copy j serves the j-th 1/r of them, which is exactly the split of
the query heads over devices. The math is unchanged; the cache holds r copies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Iterator, Optional

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from levanter.layers.attention import Attention

from engine.formats.checkpoint_config import ModelInfo
from engine.layers.fp8 import is_fp8
from engine.layers.latent_attention import LatentAttention

logger = logging.getLogger(__name__)

MODEL_AXIS = "model"


@dataclasses.dataclass(frozen=True)
class TensorParallelLayout:
    """How one model splits over `size` devices."""

    size: int
    kv_repeats: int
    """Each KV head is repeated this many times (1: KV heads split as they are)."""
    shard_vocab: bool
    """Whether the vocabulary splits evenly (else the embedding and LM head are replicated)."""

    expert_parallel: bool = False
    """Whether the experts split over the devices whole (else each expert's MLP splits)."""

    @property
    def split_parts(self) -> dict[str, int]:
        """How many parts each axis this layout splits comes in, while loading or serving (the
        experts' MLPs load split even where the experts serve split whole): what a checkpoint's
        block-scaled weights lay their scales out for (engine.layers.fp8.scale_axes)."""
        split = set(self.axis_mapping) | ({"expert_mlp"} if self.expert_parallel else set())
        return {name: self.size for name in split}

    @property
    def axis_mapping(self) -> dict[str, str]:
        if self.size == 1:
            return {}
        mapping = {"heads": MODEL_AXIS, "kv_head": MODEL_AXIS, "mlp": MODEL_AXIS}
        mapping["experts" if self.expert_parallel else "expert_mlp"] = MODEL_AXIS
        if self.shard_vocab:
            mapping["vocab"] = MODEL_AXIS
        return mapping


def plan_layout(info: ModelInfo, size: int, expert_parallel_size: Optional[int] = None) -> TensorParallelLayout:
    """The layout of `info`'s model over `size` devices; ValueError if it cannot split evenly.
    `expert_parallel_size` (1 or `size`; None: `plan_experts` picks) says how experts split."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    if info.num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's {info.num_heads} attention "
                         f"heads; pick a divisor of {info.num_heads}")
    if info.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's MLP size "
                         f"{info.intermediate_size}; pick a divisor of it")
    kv = info.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size={size} and the model's {kv} KV heads: one must divide the other")
    shard_vocab = info.vocab_size % size == 0
    if size > 1 and not shard_vocab:
        logger.warning("vocabulary of %d tokens does not split over %d devices: embedding and LM head replicated",
                       info.vocab_size, size)
    return TensorParallelLayout(size, max(1, size // kv), shard_vocab, plan_experts(info, size, expert_parallel_size))


LANES = 128
"""A TPU vector register's lanes: an expert's MLP split narrower than this runs its products in partial tiles."""


def plan_experts(info: ModelInfo, size: int, expert_parallel_size: Optional[int]) -> bool:
    """Whether `info`'s experts split whole over `size` devices (expert parallelism). Unset: when
    they divide evenly and each expert's MLP, split `size` ways, would be narrower than a lane tile
    (Qwen3-30B-A3B's 768 over 8 chips: 96) or uneven (gpt-oss-120b's MXFP4 2,880 over 16: 90 blocks
    of 32); else each expert's MLP splits. ValueError for a size the mesh cannot hold, or a split the
    experts or their MLPs do not divide into."""
    if expert_parallel_size not in (None, 1, size):
        raise ValueError(f"expert_parallel_size must be 1 or tensor_parallel_size ({size}), got "
                         f"{expert_parallel_size}: the experts split over the same devices as the rest of the model")
    if size == 1 or not info.num_experts:
        return False
    divides, width = info.num_experts % size == 0, info.expert_intermediate_size
    uneven = width % (size * info.expert_block)  # an MXFP4 expert splits in whole blocks of 32
    if expert_parallel_size is None:
        expert_parallel_size = size if divides and (width // size < LANES or uneven) else 1
    if expert_parallel_size == size and not divides:
        raise ValueError(f"expert_parallel_size={size} does not divide the model's {info.num_experts} experts; "
                         "set expert_parallel_size: 1 (each expert's MLP split instead)")
    if expert_parallel_size == 1 and uneven:
        unit = f" in blocks of {info.expert_block}" if info.expert_block > 1 else ""
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's expert MLP size {width}{unit} nor "
                         f"its {info.num_experts} experts; pick a divisor of one of them")
    return expert_parallel_size == size


def make_mesh(size: int) -> Mesh:
    devices = jax.devices()
    if size > len(devices):
        raise ValueError(f"tensor_parallel_size={size} needs {size} devices; this process sees {len(devices)} "
                         f"({devices[0].platform}). On a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={size} "
                         "makes that many host devices")
    return Mesh(np.array(devices[:size]).reshape(1, size), ("data", MODEL_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


@contextlib.contextmanager
def mesh_context(mesh: Mesh, mapping: dict[str, str]) -> Iterator[None]:
    """Enter the device mesh and an axis mapping (empty: every array replicated)."""
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping(mapping):
        yield


def place(tree, layout: TensorParallelLayout, mesh: Mesh):
    """Every named array of `tree` split over the mesh as the layout's axis mapping says."""
    return tree if layout.size == 1 else hax.shard(tree, layout.axis_mapping, mesh)


def host_device() -> Optional[jax.Device]:
    """This process's first CPU device, or None where JAX runs without its CPU platform."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


def to_mesh(tree, layout: TensorParallelLayout, mesh: Mesh):
    """`tree` made of global arrays on `mesh`, split as the layout says, wherever its arrays are now
    (the host's CPU, say). Every process passes its own whole copy and each device takes its shard
    from its own process's copy, so nothing crosses hosts; arrays already placed so stay as they are."""
    def put(x):
        named = isinstance(x, hax.NamedArray)
        array = x.array if named else x
        if not isinstance(array, jax.Array):
            return x
        spec = hax.partitioning.pspec_for_axis(x.axes, layout.axis_mapping) if named else PartitionSpec()
        target = NamedSharding(mesh, spec)
        if array.sharding == target:
            return x
        host = np.asarray(array)
        placed = jax.make_array_from_callback(host.shape, target, lambda index: host[index])
        return hax.named(placed, x.axes) if named else placed

    return jax.tree_util.tree_map(put, tree, is_leaf=lambda x: isinstance(x, hax.NamedArray))


def repeat_kv_heads(model, repeats: int):
    """Every levanter `Attention` of `model` with each KV head repeated `repeats` times; query
    heads regroup so that each still meets its own KV head (see the module docstring). A latent
    attention (DeepSeek's) keeps that many copies of its latent, one a device."""
    def repeated(module):
        if isinstance(module, LatentAttention):
            return dataclasses.replace(module, kv_copies=module.kv_copies * repeats)
        return _repeat_in_attention(module, repeats) if isinstance(module, Attention) else module

    return jax.tree_util.tree_map(repeated, model, is_leaf=lambda m: isinstance(m, (Attention, LatentAttention)))


def _repeat_in_attention(attn: Attention, r: int) -> Attention:
    kv = attn.config.num_kv_heads
    config = dataclasses.replace(attn.config, num_kv_heads=kv * r)
    group = hax.Axis("q_heads_per_group", config.q_heads_per_group)
    kv_head = hax.Axis("kv_head", kv * r)
    queries, keys = (lambda x: _regroup_queries(x, kv_head, group)), (lambda x: _repeat_axis(x, kv_head))
    sinks = getattr(attn, "sinks", None)  # per query head (gpt-oss): regrouped as the queries are
    return dataclasses.replace(
        attn,
        config=config,
        q_proj=_relinear(attn.q_proj, queries),
        k_proj=_relinear(attn.k_proj, keys),
        v_proj=_relinear(attn.v_proj, keys),
        q_norm=_renorm(attn.q_norm, queries),
        k_norm=_renorm(attn.k_norm, keys),
        **({} if sinks is None else {"sinks": queries(sinks)}),
    )


def _renorm(norm, reshape):
    """A q / k norm over whole projections (OLMo 2's: its weight has a `kv_head` axis) with its
    weight passed through `reshape`; a per-head norm (Qwen 3's) or none as it is. The mean square
    over repeated heads is the original's."""
    if norm is None or norm.weight is None or not norm.weight.has_axis("kv_head"):
        return norm
    weight = reshape(norm.weight)
    bias = None if norm.bias is None else reshape(norm.bias)
    axis = tuple(weight.resolve_axis(ax.name) for ax in hax.axis_spec_to_tuple(norm.axis))
    return dataclasses.replace(norm, weight=weight, bias=bias, axis=axis)


def _relinear(linear, reshape):
    """`linear` (haliax's, or an FP8 one with its scales) with its weight, bias and output axes
    passed through `reshape` (a NamedArray map)."""
    weight = reshape(linear.weight)
    bias = None if linear.bias is None else reshape(linear.bias)
    out_names = [ax.name for ax in hax.axis_spec_to_tuple(linear.Out)]
    Out = tuple(weight.resolve_axis(name) for name in out_names)
    scales = {"scale": reshape(linear.scale)} if is_fp8(linear) else {}
    return dataclasses.replace(linear, weight=weight, bias=bias, Out=Out, **scales)


def _repeat_axis(x: hax.NamedArray, kv_head: hax.Axis) -> hax.NamedArray:
    """Repeat each entry of `kv_head` consecutively: (h0, h0, h1, h1, ...)."""
    index = x.axes.index(x.resolve_axis("kv_head"))
    repeats = kv_head.size // x.axes[index].size
    axes = x.axes[:index] + (kv_head,) + x.axes[index + 1:]
    return hax.named(jnp.repeat(x.array, repeats, axis=index), axes)


def _regroup_queries(x: hax.NamedArray, kv_head: hax.Axis, group: hax.Axis) -> hax.NamedArray:
    """(kv_head K, q_heads_per_group G) -> (K * r, G / r): the same query heads in the same order."""
    flat = x.flatten_axes(("kv_head", "q_heads_per_group"), "q_heads")  # kv_head major
    return flat.unflatten_axis("q_heads", (kv_head, group))


def free_device_memory(devices) -> Optional[int]:
    """Bytes each of this process's `devices` can still allocate (the least of them), or None where
    the platform does not say (CPUs)."""
    free = []
    for device in [d for d in devices if d.process_index == jax.process_index()]:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return min(free)
