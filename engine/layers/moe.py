"""A mixture of experts (Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V3): a router scores every expert for
each token, the token's hidden state goes through its top-k experts (gated MLPs), and their outputs
are summed with the router's weights, as transformers computes them; DeepSeek-V3 adds a shared MLP
that every token goes through.

Dispatch: a step's (token, choice) pairs are sorted by expert so that each expert's rows are
contiguous, the experts run as grouped products over those rows (haliax's `MoELinear`:
`jax.lax.ragged_dot`, or a quantized product with the same call), and each output goes back to its
token. The expert weights are stacked (experts, in, out). Over several devices either each
expert's MLP splits (`expert_mlp`, as a dense MLP does) or the experts split whole (`experts`:
expert parallelism, `dispatch_split`), as engine.generate.runner.sharding's axis mapping says.

The checkpoint's experts are one module per expert (`{prefix}.{i}.{gate,up,down}_proj.weight` in
Qwen3-MoE, `w1`, `w3`, `w2` in Mixtral); `ExpertMlps.from_state_dict` stacks them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import NamedArray
from haliax.state_dict import ModuleWithStateDictSerialization, StateDict, with_prefix
from jax.sharding import PartitionSpec
from levanter.models.llama import LlamaMlp

EXPERTS = "experts"
EXPERT_MLP = "expert_mlp"
"""An expert's MLP axis: named apart from a dense MLP's, so experts split over the devices (expert
parallelism, axis `experts`) or each expert's MLP does (`expert_mlp`), whatever the dense MLPs do."""
SCORES = "expert_scores"
"""The router's output axis: one score per expert, named apart from `experts` so that the router
stays whole on every device when the experts split (its logits then need no gathering)."""
SHARED_MLP = "mlp"
"""The shared MLP's hidden axis: a dense MLP's, so it splits over the devices as a dense MLP does."""
TOP = "top_experts"
ROWS = "expert_rows"
"""The step's (token, choice) pairs, sorted by expert."""


SCORINGS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class Routing:
    """How a token's experts and their weights follow from the router's logits (in float32):
    - "softmax" (Mixtral, Qwen3-MoE, gpt-oss): a softmax over all experts, the `top_k` largest,
      rescaled to sum to 1 if `normalize`; or, `after_top_k`, the `top_k` largest logits and a
      softmax over those alone (gpt-oss).
    - "sigmoid" (DeepSeek-V3): scores sigmoid(logits); the experts are chosen by score + the block's
      learned correction bias, among the `topk_group` of `n_group` groups of experts whose two best
      biased scores sum highest (the other groups' scores set to 0, as transformers does); their
      weights are their scores without the bias, divided by their sum (+ 1e-20) if `normalize`.
    Every mode's weights are then multiplied by `scaling`."""

    top_k: int
    normalize: bool = True
    """Mixtral always; Qwen3-MoE and DeepSeek-V3 as their `norm_topk_prob` says."""
    after_top_k: bool = False
    scoring: str = "softmax"
    """One of SCORINGS."""
    n_group: int = 1
    """Groups of experts (contiguous, equal) for the sigmoid choice; 1: no groups."""
    topk_group: int = 1
    """How many of the `n_group` groups a token's experts may come from."""
    scaling: float = 1.0
    """DeepSeek-V3's `routed_scaling_factor`."""

    def __post_init__(self):
        if self.scoring not in SCORINGS:
            raise ValueError(f"routing scoring {self.scoring!r} is not one of {SCORINGS}")
        if self.scoring != "softmax" and self.after_top_k:
            raise ValueError("after_top_k (a softmax over the top-k logits) needs scoring 'softmax'")
        if self.n_group > 1 and self.scoring != "sigmoid":
            raise ValueError(f"expert groups (n_group={self.n_group}) are supported with scoring 'sigmoid' only")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be between 1 and n_group ({self.n_group}), got {self.topk_group}")

    def choose(self, logits: NamedArray, bias: Optional[NamedArray] = None) -> tuple[NamedArray, NamedArray]:
        """(weights f32[..., top_experts], experts i32[..., top_experts]) of router logits
        [..., expert_scores]; `bias` [expert_scores]: the sigmoid choice's correction bias."""
        logits = logits.rearrange((..., SCORES))
        raw = logits.array.astype(jnp.float32)
        if self.scoring == "sigmoid":
            weights, experts = self._sigmoid(raw, bias)
        elif self.after_top_k:
            top, experts = jax.lax.top_k(raw, self.top_k)
            weights = jax.nn.softmax(top, axis=-1)
        else:
            weights, experts = jax.lax.top_k(jax.nn.softmax(raw, axis=-1), self.top_k)
            if self.normalize:
                weights = weights / weights.sum(axis=-1, keepdims=True)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        axes = (*logits.axes[:-1], hax.Axis(TOP, self.top_k))
        return hax.named(weights, axes), hax.named(experts, axes)

    def _sigmoid(self, logits: jax.Array, bias: Optional[NamedArray]) -> tuple[jax.Array, jax.Array]:
        scores = jax.nn.sigmoid(logits)
        for_choice = scores if bias is None else scores + bias.rearrange((SCORES,)).array.astype(jnp.float32)
        _, experts = jax.lax.top_k(self._in_best_groups(for_choice), self.top_k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if self.normalize:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return weights, experts

    def _in_best_groups(self, scores: jax.Array) -> jax.Array:
        """`scores` [..., experts] with those outside each token's `topk_group` best groups set to 0
        (a group's score: the sum of its two best)."""
        if self.n_group == 1:
            return scores
        count = scores.shape[-1]
        if count % self.n_group or count // self.n_group < 2:
            raise ValueError(f"n_group={self.n_group} must split the router's {count} experts into equal groups "
                             "of at least 2")
        grouped = scores.reshape(*scores.shape[:-1], self.n_group, count // self.n_group)
        _, best = jax.lax.top_k(jax.lax.top_k(grouped, 2)[0].sum(axis=-1), self.topk_group)
        kept = (best[..., :, None] == jnp.arange(self.n_group)).any(axis=-2)
        return jnp.where(kept[..., None], grouped, 0.0).reshape(scores.shape)


SWIGLU_ALPHA = 1.702
"""gpt-oss's clamped SwiGLU: gate * sigmoid(alpha * gate)."""


class ExpertMlps(ModuleWithStateDictSerialization):
    """Every expert's gated MLP, down(act(gate(x)) * up(x)), stacked on the `experts` axis; rows come
    grouped by expert (`group_sizes`, in expert order). With `biases` (gpt-oss), each projection adds
    its expert's own bias; with `swiglu_limit`, the gating is gpt-oss's clamped one (`gated`)."""

    gate_proj: hnn.MoELinear
    up_proj: hnn.MoELinear
    down_proj: hnn.MoELinear
    act: Callable = eqx.field(static=True)
    names: tuple[str, str, str] = eqx.field(static=True, default=("gate_proj", "up_proj", "down_proj"))
    """The checkpoint's names of the gate, up and down projections of one expert."""
    biases: Optional[tuple[NamedArray, NamedArray, NamedArray]] = None
    """(gate, up, down) biases, each (..., experts, out)."""
    swiglu_limit: Optional[float] = eqx.field(static=True, default=None)

    @staticmethod
    def init(Experts: hax.Axis, Embed: hax.Axis, Mlp: hax.Axis, act: Callable, *, key,
             names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), biases: bool = False,
             swiglu_limit: Optional[float] = None) -> "ExpertMlps":
        k_gate, k_up, k_down = jax.random.split(key, 3)
        zeros = (hax.zeros((Experts, Mlp)), hax.zeros((Experts, Mlp)), hax.zeros((Experts, Embed))) if biases else None
        return ExpertMlps(hnn.MoELinear.init(Experts, Embed, Mlp, key=k_gate, use_bias=False),
                          hnn.MoELinear.init(Experts, Embed, Mlp, key=k_up, use_bias=False),
                          hnn.MoELinear.init(Experts, Mlp, Embed, key=k_down, use_bias=False), act, names, zeros,
                          swiglu_limit)

    def gated(self, gate, up):
        """act(gate) * up; gpt-oss's (with `swiglu_limit` L): gate clipped to <= L, up to [-L, L], then
        (up + 1) * gate * sigmoid(1.702 gate)."""
        if self.swiglu_limit is None:
            return self.act(gate) * up
        named = isinstance(gate, NamedArray)
        clip, sigmoid = (hax.clip, hnn.sigmoid) if named else (jnp.clip, jax.nn.sigmoid)
        gate, up = clip(gate, None, self.swiglu_limit), clip(up, -self.swiglu_limit, self.swiglu_limit)
        return (up + 1) * gate * sigmoid(gate * SWIGLU_ALPHA)

    def __call__(self, rows: NamedArray, group_sizes: NamedArray) -> NamedArray:
        gate, up = self.gate_proj(rows, group_sizes), self.up_proj(rows, group_sizes)
        if self.biases is not None:
            gate, up = self._biased(gate, 0, group_sizes), self._biased(up, 1, group_sizes)
        hidden = self.gated(gate, up)
        out = self.down_proj(hidden, group_sizes)
        return out if self.biases is None else self._biased(out, 2, group_sizes)

    def _biased(self, out: NamedArray, which: int, group_sizes: NamedArray) -> NamedArray:
        """`out` (rows grouped by expert, out) plus each row's expert's bias `which`."""
        bias = self.biases[which]
        Experts = bias.resolve_axis(EXPERTS)
        Rows, Out = out.axes[0], bias.axes[-1]
        expert = jnp.repeat(jnp.arange(Experts.size), group_sizes.rearrange((Experts,)).array,
                            total_repeat_length=Rows.size)
        return out + hax.named(bias.rearrange((Experts, Out)).array[expert], (Rows, Out))

    def one(self, expert: jax.Array, rows: jax.Array) -> jax.Array:
        """Expert `expert`'s MLP over `rows` f[R, embed] (plain arrays)."""
        projections = (self.gate_proj, self.up_proj, self.down_proj)

        def product(which: int, x: jax.Array) -> jax.Array:
            out = _product(projections[which], expert, x)
            if self.biases is None:
                return out
            bias = self.biases[which]
            return out + bias.rearrange((EXPERTS, bias.axes[-1])).array[expert].astype(out.dtype)

        return product(2, self.gated(product(0, rows), product(1, rows)))

    def from_state_dict(self, state_dict: StateDict, prefix: Optional[str] = None) -> "ExpertMlps":
        """Each projection from the checkpoint's (out, in) weights: one per expert
        (`{i}.{name}.weight`), or stacked already (`{name}.weight`: [..., experts, out, in]), after any
        leading (layer) axes the state dict stacked; a quantized projection (one with `loaded`:
        engine.layers.fp8, engine.layers.mxfp4) with its tensors; biases as `{name}.bias`."""
        fields = ("gate_proj", "up_proj", "down_proj")
        filled = [_filled(getattr(self, f), state_dict, prefix, name) for f, name in zip(fields, self.names)]
        module = eqx.tree_at(lambda m: [getattr(m, f) for f in fields], self, filled)
        if self.biases is None:
            return module
        biases = tuple(hax.named(_stacked(state_dict, prefix, name, "bias", count=self.gate_proj.Experts.size), b.axes)
                       for name, b in zip(self.names, self.biases))
        return eqx.tree_at(lambda m: m.biases, module, biases)


def _stacked(state_dict: StateDict, prefix: Optional[str], name: str, tensor: str, count: int) -> jax.Array:
    """`{name}.{tensor}` of every expert, stacked on the axis after the state dict's leading (layer)
    axes: as the checkpoint stacks it, or each expert's `{i}.{name}.{tensor}` stacked here."""
    whole = with_prefix(prefix, f"{name}.{tensor}")
    if whole in state_dict:
        return jnp.asarray(state_dict[whole])
    lead = jnp.ndim(state_dict[with_prefix(prefix, f"0.{name}.weight")]) - 2
    return jnp.stack([jnp.asarray(state_dict[with_prefix(prefix, f"{i}.{name}.{tensor}")]) for i in range(count)],
                     axis=lead)


def _filled(linear, state_dict: StateDict, prefix: Optional[str], name: str):
    """One grouped product filled from the checkpoint: a float one's weights transposed to (in, out)."""
    count = linear.Experts.size
    if hasattr(linear, "loaded"):
        return linear.loaded({tensor: _stacked(state_dict, prefix, name, tensor, count)
                              for tensor in linear.checkpoint_tensors})
    weight = jnp.swapaxes(_stacked(state_dict, prefix, name, "weight", count), -1, -2)
    return eqx.tree_at(lambda m: m.weight.array, linear, weight)


def _product(linear, expert: jax.Array, rows: jax.Array) -> jax.Array:
    """rows @ expert `expert`'s weight of a grouped product (haliax's MoELinear, or a quantized one:
    its `expert_product`), in float32, rounded to the rows' dtype. A bfloat16 weight is held as its
    bits (`for_platform`) and widened here, one expert at a time: XLA on CPUs would widen a
    bfloat16 array whole, every expert, before the loop."""
    if hasattr(linear, "expert_product"):
        out = linear.expert_product(expert, rows)
    else:
        weight = linear.weight.rearrange((linear.Experts, linear.In, linear.Out)).array[expert]
        if weight.dtype == jnp.uint16:
            weight = jax.lax.bitcast_convert_type(weight.astype(jnp.uint32) << 16, jnp.float32)
        out = rows.astype(jnp.float32) @ weight.astype(jnp.float32)
    out = out.astype(rows.dtype)
    return out if linear.bias is None else out + linear.bias.array


class MoE(ModuleWithStateDictSerialization):
    """A sparse MoE block: `gate` (the router, embed -> expert_scores), `experts`, `routing`; with
    DeepSeek-V3's `correction_bias` (the router's learned per-expert bias for choosing; checkpoint
    `gate.e_score_correction_bias`) and `shared` (a dense gated MLP every token goes through, added
    to the experts' sum; checkpoint `shared_experts`). The router and its bias stay whole on every
    device (axis `expert_scores`); the shared MLP's hidden axis is a dense MLP's (`mlp`) and splits
    as one."""

    gate: hnn.Linear
    experts: ExpertMlps
    routing: Routing = eqx.field(static=True)
    tiled: bool = eqx.field(static=True, default=False)
    """Run the experts tile by tile (`dispatch_tiled`): where a grouped product runs as a product
    over every expert (XLA on CPUs; `for_platform` sets it, and only it may hold bfloat16 expert
    weights as bits)."""
    correction_bias: Optional[NamedArray] = None
    """[expert_scores], float: added to the sigmoid scores for choosing only (Routing)."""
    shared: Optional[LlamaMlp] = None

    @staticmethod
    def init(Embed: hax.Axis, Experts: hax.Axis, Mlp: hax.Axis, routing: Routing, act: Callable, *,
             key, router_bias: bool = False, correction_bias: bool = False, shared_mlp: int = 0,
             **experts) -> "MoE":
        """`correction_bias`: a learned choice bias (sigmoid routing; zeros until loaded);
        `shared_mlp`: the shared MLP's width (DeepSeek-V3: moe_intermediate_size * n_shared_experts;
        0: none); `experts`: ExpertMlps.init's options (biases, swiglu_limit)."""
        if correction_bias and routing.scoring != "sigmoid":
            raise ValueError("a correction bias is added to sigmoid scores: it needs Routing(scoring='sigmoid')")
        k_router, k_experts = jax.random.split(key)
        Scores = Experts.alias(SCORES)
        router = hnn.Linear.init(Embed, Scores, key=k_router, use_bias=router_bias, out_first=True)
        bias = hax.zeros(Scores, dtype=jnp.float32) if correction_bias else None
        shared = None
        if shared_mlp:
            shared = LlamaMlp.init(Embed, hax.Axis(SHARED_MLP, shared_mlp), act, key=jax.random.fold_in(key, 2))
        return MoE(router, ExpertMlps.init(Experts, Embed, Mlp, act, key=k_experts, **experts), routing,
                   correction_bias=bias, shared=shared)

    def _state_dict_key_map(self) -> dict[str, Optional[str]]:
        return {"correction_bias": "gate.e_score_correction_bias", "shared": "shared_experts"}

    def route(self, x: NamedArray) -> tuple[NamedArray, NamedArray]:
        """(weights, experts) of each token of x (..., embed): Routing.choose of the router's logits,
        which sigmoid routing computes in float32 (as transformers reads the router's weight)."""
        inputs = x.astype(jnp.float32) if self.routing.scoring == "sigmoid" else x
        return self.routing.choose(self.gate(inputs, key=None), self.correction_bias)

    def __call__(self, x: NamedArray, *, key=None) -> NamedArray:
        """x (position, embed) -> (position, embed)."""
        del key
        weights, chosen = self.route(x)
        run = dispatch_tiled if self.tiled else dispatch
        axis = hax.partitioning.physical_axis_name(EXPERTS)
        if axis is None:
            out = run(x, weights, chosen, self.experts)
        else:
            out = dispatch_split(x, weights, chosen, self.experts, axis, run)
        return out if self.shared is None else out + self.shared(x, key=None)


def dispatch(x: NamedArray, weights: NamedArray, chosen: NamedArray, experts: ExpertMlps) -> NamedArray:
    """Σ_k weights[t, k] · expert_{chosen[t, k]}(x[t]) for every token t of x (position, embed):
    the (token, choice) pairs sorted by expert, run as grouped products, put back in token order.
    A choice at or past `experts`' count names an expert held elsewhere and adds nothing."""
    Pos, Embed = x.axes
    Top = weights.resolve_axis(TOP)
    Experts = experts.gate_proj.Experts
    flat = chosen.rearrange((Pos, Top)).array.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # choices held elsewhere sort last, in no group
    Rows = hax.Axis(ROWS, flat.size)
    rows = hax.named(x.array[order // Top.size], (Rows, Embed))
    group_sizes = hax.named(jnp.bincount(flat, length=Experts.size).astype(jnp.int32), Experts)
    out = experts(rows, group_sizes).rearrange((Rows, Embed)).array
    by_token = jnp.zeros_like(out).at[order].set(out).reshape(Pos.size, Top.size, Embed.size)
    held = (flat < Experts.size).reshape(Pos.size, Top.size, 1)
    scaled = jnp.where(held, by_token * weights.rearrange((Pos, Top)).array.astype(out.dtype)[..., None], 0)
    return hax.named(scaled.sum(axis=1), (Pos, Embed))


def dispatch_split(x: NamedArray, weights: NamedArray, chosen: NamedArray, experts: ExpertMlps, axis: str,
                   run=dispatch) -> NamedArray:
    """`run` (`dispatch` or `dispatch_tiled`) with the experts split over the mesh axis `axis`
    (expert parallelism): the tokens are replicated, so each device runs the rows of its own
    experts, and the partial sums add up over `axis` (one all-reduce, as after a tensor-parallel
    MLP)."""
    leaves, treedef = jax.tree_util.tree_flatten(experts, is_leaf=lambda leaf: isinstance(leaf, NamedArray))
    specs = [hax.partitioning.pspec_for_axis(leaf.axes) for leaf in leaves]

    def local(x_, weights_, chosen_, *arrays):
        mine = jax.tree_util.tree_unflatten(treedef, [
            hax.named(a, tuple(ax.resize(n) for ax, n in zip(leaf.axes, a.shape))) for leaf, a in zip(leaves, arrays)])
        count = next(a.shape[leaf.axes.index(leaf.resolve_axis(EXPERTS))] for leaf, a in zip(leaves, arrays)
                     if leaf.has_axis(EXPERTS))
        mine = jax.tree_util.tree_map(  # the grouped products' own `Experts` axis, resized as their arrays
            lambda m: dataclasses.replace(m, Experts=m.Experts.resize(count)) if _stacks_experts(m) else m, mine,
            is_leaf=_stacks_experts)
        shifted = chosen_ - jax.lax.axis_index(axis) * count
        shifted = jnp.where((shifted >= 0) & (shifted < count), shifted, count)
        out = run(hax.named(x_, x.axes), hax.named(weights_, weights.axes), hax.named(shifted, chosen.axes), mine)
        return jax.lax.psum(out.array, axis)

    replicated = PartitionSpec()
    out = jax.shard_map(local, in_specs=(replicated, replicated, replicated, *specs), out_specs=replicated,
                        check_vma=False)(x.array, weights.array, chosen.array, *(leaf.array for leaf in leaves))
    return hax.named(out, x.axes)


def _stacks_experts(module) -> bool:
    """A grouped product's module (its own static `Experts` axis), not an array of the experts."""
    return isinstance(getattr(module, "Experts", None), hax.Axis)


def dispatch_tiled(x: NamedArray, weights: NamedArray, chosen: NamedArray, experts: ExpertMlps,
                   tile: int = 8) -> NamedArray:
    """`dispatch` for CPUs, where XLA runs a grouped product as a product over every expert: the
    rows sorted by expert, each expert's padded to whole tiles of `tile` rows, and a loop over the
    tiles that hold rows runs each through its own expert alone. A step then reads each chosen
    expert's weights once per tile of its rows and computes only those rows (and the padding)."""
    Pos, Embed = x.axes
    Top = weights.resolve_axis(TOP)
    count = experts.gate_proj.Experts.size
    flat = chosen.rearrange((Pos, Top)).array.reshape(-1)
    rows = flat.size
    order = jnp.argsort(flat, stable=True)
    expert = flat[order]
    held = expert < count
    sizes = jnp.bincount(flat, length=count)
    tiles = (sizes + tile - 1) // tile
    tile_end = jnp.cumsum(tiles)
    rank = jnp.arange(rows) - (jnp.cumsum(sizes) - sizes)[jnp.minimum(expert, count - 1)]
    max_tiles = -(-rows // tile) + min(count, rows)  # every expert's last tile may be partly empty
    slot = jnp.where(held, (tile_end - tiles)[jnp.minimum(expert, count - 1)] * tile + rank, max_tiles * tile)
    padded = jnp.zeros((max_tiles * tile, Embed.size), x.dtype).at[slot].set(x.array[order // Top.size], mode="drop")
    tile_expert = jnp.searchsorted(tile_end, jnp.arange(max_tiles), side="right")

    def run_tile(i, out):
        start = i * tile
        ys = experts.one(tile_expert[i], jax.lax.dynamic_slice_in_dim(padded, start, tile))
        return jax.lax.dynamic_update_slice_in_dim(out, ys, start, axis=0)

    out = jax.lax.fori_loop(0, tile_end[-1], run_tile, jnp.zeros_like(padded))
    by_choice = jnp.zeros((rows, Embed.size), x.dtype).at[order].set(out[jnp.minimum(slot, max_tiles * tile - 1)])
    scaled = jnp.where((flat < count)[:, None], by_choice * weights.rearrange((Pos, Top)).array.reshape(
        -1, 1).astype(x.dtype), 0)
    return hax.named(scaled.reshape(Pos.size, Top.size, Embed.size).sum(axis=1), (Pos, Embed))


def for_platform(model, platform: str):
    """`model` with every MoE set to run as suits `platform`: on "cpu", tile by tile, its bfloat16
    expert weights held as their bits (`_product` widens them), unless its grouped products are
    fast there already (a backend's own modules, `runs_grouped`: engine.backends.cpu.packed_experts)."""
    def bits(linear):
        if isinstance(linear, hnn.MoELinear) and linear.weight.dtype == jnp.bfloat16:
            weight = linear.weight
            return dataclasses.replace(linear, weight=hax.named(jax.lax.bitcast_convert_type(weight.array, jnp.uint16),
                                                                weight.axes))
        return linear

    def prepared(moe: MoE) -> MoE:
        if platform != "cpu" or getattr(moe.experts.gate_proj, "runs_grouped", False):
            return moe
        experts = jax.tree_util.tree_map(bits, moe.experts, is_leaf=lambda m: isinstance(m, hnn.MoELinear))
        return dataclasses.replace(moe, experts=experts, tiled=True)

    return jax.tree_util.tree_map(lambda m: prepared(m) if isinstance(m, MoE) else m, model,
                                  is_leaf=lambda m: isinstance(m, MoE))


def from_levanter_mixtral(block) -> MoE:
    """levanter's `MixtralSparseMoeBlock` (loaded) as a `MoE` over the same arrays, its experts'
    `mlp` axis renamed `expert_mlp` and its router's `experts` axis `expert_scores`."""
    experts = block.experts
    w1, w3, w2 = (_renamed(linear, experts.Mlp.name, EXPERT_MLP) for linear in (experts.w1, experts.w3, experts.w2))
    mlps = ExpertMlps(w1, w3, w2, experts.act, ("w1", "w3", "w2"))
    gate = block.gate
    router = dataclasses.replace(gate, weight=gate.weight.rename({EXPERTS: SCORES}), Out=gate.Out.alias(SCORES))
    return MoE(router, mlps, Routing(block.config.num_experts_per_tok, normalize=True))


def _renamed(linear: hnn.MoELinear, old: str, new: str) -> hnn.MoELinear:
    rename = lambda axis: axis.alias(new) if axis.name == old else axis  # noqa: E731
    return dataclasses.replace(linear, weight=linear.weight.rename({old: new}), In=rename(linear.In),
                               Out=rename(linear.Out))
