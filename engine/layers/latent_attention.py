"""Multi-head latent attention (DeepSeek-V2 / V3), served absorbed: the cache holds per token and
layer one vector, the key's RoPE part and the normed compressed latent (64 + 512 = 576 values for
DeepSeek-V3), and every head attends over it as multi-query attention.

transformers computes per head k = [kv_b_k(c), rope(k_pe)], v = kv_b_v(c) from the latent c. Since
q_nope . kv_b_k(c) = (kv_b_k^T q_nope) . c, a query absorbs its head's key projection, and since
sum_j p_j kv_b_v(c_j) = kv_b_v(sum_j p_j c_j), the head's value projection applies once to the
attended latent. So each head's query is [rope(q_pe), kv_b_k^T q_nope] (576), the one key and value
are [rope(k_pe), c] (576), and the output's latent part goes through kv_b_v, then o_proj: the
backends attend as over any one-KV-head model (the value's RoPE part is attended too, and dropped).

Axes: the query heads `heads` (split over the devices as any model's heads); the cache's KV head
is the latent, copied once per device (`kv_copies`, as repeated KV heads are), so a device's query
heads are (kv_head = its copy, q_heads_per_group = its share of the heads). The RoPE part comes
first so that the rotated dimensions are a head's first (engine.layers.rope's partial rotation).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
from haliax import NamedArray
from haliax.state_dict import ModuleWithStateDictSerialization

from engine.layers.rope import rotate

HEADS, ROPE_PART = "heads", "head_size"


@dataclasses.dataclass(frozen=True)
class LatentSizes:
    """DeepSeek's attention sizes (config.json's names)."""

    num_heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scaling: float
    """The softmax scale: qk_head_dim ** -0.5, times YaRN's mscale squared where config.json says."""
    eps: float = 1e-6
    attention_bias: bool = False


class LatentAttention(ModuleWithStateDictSerialization):
    """DeepSeek's attention with transformers' weights and names (q_a_proj, q_a_layernorm, q_b_proj
    or q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj), computed absorbed."""

    q_a_proj: Optional[hnn.Linear]
    q_a_layernorm: Optional[hnn.RmsNorm]
    q_b_proj: Optional[hnn.Linear]
    q_proj: Optional[hnn.Linear]
    kv_a_proj_with_mqa: hnn.Linear
    kv_a_layernorm: hnn.RmsNorm
    kv_b_proj: NamedArray
    """The latent's key and value projections (heads, kv_b = nope + v, latent): a weight the queries
    and outputs absorb, never a product of its own (so in float, and never packed by a backend)."""
    o_proj: hnn.Linear
    sizes: LatentSizes = eqx.field(static=True)
    kv_copies: int = eqx.field(static=True, default=1)
    """Copies of the latent in the cache (one per device under tensor parallelism)."""

    @staticmethod
    def init(Embed: hax.Axis, sizes: LatentSizes, *, key) -> "LatentAttention":
        k = jax.random.split(key, 6)
        Heads = hax.Axis(HEADS, sizes.num_heads)
        QHead = hax.Axis("q_head", sizes.qk_nope_head_dim + sizes.qk_rope_head_dim)
        Latent = hax.Axis("latent", sizes.kv_lora_rank)
        LatentRope = hax.Axis("latent_rope", sizes.kv_lora_rank + sizes.qk_rope_head_dim)
        KvHead = hax.Axis("kv_b", sizes.qk_nope_head_dim + sizes.v_head_dim)
        VHead = hax.Axis("v_head", sizes.v_head_dim)
        linear = _linears(sizes.attention_bias)
        if sizes.q_lora_rank is None:
            q_a, q_norm, q_b, q = None, None, None, linear(Embed, (Heads, QHead), k[0], False)
        else:
            QLora = hax.Axis("q_lora", sizes.q_lora_rank)
            q_a, q = linear(Embed, QLora, k[0]), None
            q_norm = hnn.RmsNorm.init(QLora, eps=sizes.eps, use_bias=False)
            q_b = linear(QLora, (Heads, QHead), k[1], False)
        kv_b = hax.random.normal(k[3], (Heads, KvHead, Latent)) * sizes.kv_lora_rank ** -0.5
        return LatentAttention(q_a, q_norm, q_b, q, linear(Embed, LatentRope, k[2]),
                               hnn.RmsNorm.init(Latent, eps=sizes.eps, use_bias=False), kv_b,
                               linear((Heads, VHead), Embed, k[4]), sizes)

    def _state_dict_key_map(self) -> dict[str, Optional[str]]:
        return {"kv_b_proj": "kv_b_proj.weight"}  # shaped (heads, kv_b, latent) on load (engine.models.decoder)

    def project(self, h: NamedArray, tables) -> tuple[NamedArray, NamedArray, NamedArray]:
        """(q (position, kv_head, q_heads_per_group, head_size), k, v (position, kv_head, head_size))
        of h (position, embed): the absorbed queries and the latent key (its value too)."""
        s = self.sizes
        if self.q_proj is not None:
            q = self.q_proj(h)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        q_nope, q_pe = q["q_head", :s.qk_nope_head_dim], q["q_head", s.qk_nope_head_dim:]
        latent_rope = self.kv_a_proj_with_mqa(h)
        c = self.kv_a_layernorm(latent_rope["latent_rope", :s.kv_lora_rank].rename({"latent_rope": "latent"}))
        k_pe = latent_rope["latent_rope", s.kv_lora_rank:].rename({"latent_rope": ROPE_PART})
        RopePart = hax.Axis(ROPE_PART, s.qk_rope_head_dim)
        q_pe, k_pe = rotate(q_pe.rename({"q_head": ROPE_PART}), tables, RopePart), rotate(k_pe, tables, RopePart)
        w_k = self._kv_b()["kv_b", :s.qk_nope_head_dim]  # (heads, kv_b = nope, latent)
        q_latent = hax.dot(q_nope.rename({"q_head": "kv_b"}), w_k.astype(q_nope.dtype), axis="kv_b")
        Head = hax.Axis("head_size", s.qk_rope_head_dim + s.kv_lora_rank)
        q = hax.concatenate(Head.name, (q_pe, q_latent.astype(q_pe.dtype).rename({"latent": Head.name})))
        k = hax.concatenate(Head.name, (k_pe, c.astype(k_pe.dtype).rename({"latent": Head.name})))
        Copies = hax.Axis("kv_head", self.kv_copies)
        group = hax.Axis("q_heads_per_group", s.num_heads // self.kv_copies)
        q = q.unflatten_axis(HEADS, (Copies, group))
        k = hax.broadcast_axis(k, Copies)
        return q, k, k

    def output(self, o: NamedArray) -> NamedArray:
        """o (position, kv_head, q_heads_per_group, head_size) attended -> (position, embed): each head's
        latent part through its value projection, then o_proj."""
        s = self.sizes
        latent = o.flatten_axes(("kv_head", "q_heads_per_group"), HEADS)["head_size", s.qk_rope_head_dim:]
        w_v = self._kv_b()["kv_b", s.qk_nope_head_dim:].rename({"kv_b": "v_head"})  # (heads, v_head, latent)
        values = hax.dot(latent.rename({"head_size": "latent"}), w_v.astype(latent.dtype), axis="latent")
        return self.o_proj(values.astype(o.dtype))

    def _kv_b(self) -> NamedArray:
        return self.kv_b_proj.rearrange((HEADS, "kv_b", "latent"))


def _linears(bias: bool):
    """hnn.Linear.init(In, Out, key) with the attention's bias rule: a bias where the checkpoint has
    `attention_bias` and the projection takes one (q_a, kv_a, o)."""
    def linear(In, Out, key, biased: bool = True) -> hnn.Linear:
        return hnn.Linear.init(In, Out, key=key, use_bias=bias and biased, out_first=True)

    return linear
