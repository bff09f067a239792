"""The transformer encoder layer that BERT (engine.models.encoder) and LLaVA's CLIP / SigLIP vision
towers (engine.models.vision) share, and how a torch checkpoint's tensors become one.

A layer is bidirectional self-attention over one fused query/key/value projection, then an MLP (up,
activation, down), each inside a residual. With `pre_norm` each block's LayerNorm comes before it,
x + f(norm(x)) (CLIP, SigLIP); without, after the residual sum, norm(x + f(x)) (BERT).

Named axes: "position" (the tokens; "key_position" inside attention), "embed", "qkv", "heads",
"head_size", "mlp"; any other axis (batch, image) is carried through. Weights are stored
(In..., Out...), as `loading.inputs_first` lays out the decoder's, so no call transposes a weight.
In bfloat16, the LayerNorm statistics and the softmax (and its scores) run in float32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Optional

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax.numpy as jnp
import numpy as np

Pos, KPos = "position", "key_position"
MASKED_SCORE = -1e9
"""Given to the attention scores of masked keys: exp() of it is 0 in float32."""
ACTIVATIONS: dict[str, Callable[[hax.NamedArray], hax.NamedArray]] = {
    "gelu": lambda x: hnn.gelu(x, approximate=False),
    "gelu_new": lambda x: hnn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: hnn.gelu(x, approximate=True),
    "quick_gelu": hnn.quick_gelu,
}
"""transformers' activation names (ACT2FN) served: `gelu` is erf's GELU, the two tanh ones are equal."""


@dataclasses.dataclass(frozen=True)
class EncoderSizes:
    """The sizes of a stack of encoder layers, as a config.json names them."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    layer_norm_eps: float
    hidden_act: str
    """A key of `ACTIVATIONS`: the MLP's activation."""

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads


@dataclasses.dataclass(frozen=True)
class LayerAxes:
    embed: hax.Axis
    qkv: hax.Axis
    heads: hax.Axis
    head_size: hax.Axis
    mlp: hax.Axis

    @staticmethod
    def of(sizes: EncoderSizes) -> LayerAxes:
        return LayerAxes(hax.Axis("embed", sizes.hidden_size), hax.Axis("qkv", 3), hax.Axis("heads", sizes.num_heads),
                         hax.Axis("head_size", sizes.head_size), hax.Axis("mlp", sizes.intermediate_size))


def layer_norm(norm: hnn.LayerNorm, x: hax.NamedArray) -> hax.NamedArray:
    """`norm` with float32 statistics, returned in x's dtype."""
    return norm(x.astype(jnp.float32)).astype(x.dtype)


class SelfAttention(eqx.Module):
    qkv: hnn.Linear
    """embed -> (qkv, heads, head_size): query, key and value in one product."""
    out: hnn.Linear
    """(heads, head_size) -> embed."""
    scale_query: bool = eqx.field(static=True)
    """True: q is scaled in its own dtype before the dot, whose result is then cast to float32 (BERT);
    False: the dot accumulates in float32 and the scores are scaled (CLIP, SigLIP). The two orders
    round differently, in float32 too; each model keeps the one its parity tests measure."""

    def __call__(self, x: hax.NamedArray, key_mask: Optional[hax.NamedArray] = None) -> hax.NamedArray:
        """x: [..., position, embed] -> the same. key_mask: [..., key_position], True for the keys
        attended to; None attends to every key."""
        qkv = self.qkv(x)
        q, k, v = (qkv["qkv", i] for i in range(3))
        k, v = k.rename({Pos: KPos}), v.rename({Pos: KPos})
        scores = self._scores(q, k)
        if key_mask is not None:
            scores = hax.where(key_mask, scores, MASKED_SCORE)
        weights = hnn.softmax(scores, axis=KPos).astype(v.dtype)
        return self.out(hax.dot(weights, v, axis=KPos))

    def _scores(self, q: hax.NamedArray, k: hax.NamedArray) -> hax.NamedArray:
        """q . k / sqrt(head_size), float32."""
        scale = 1.0 / np.sqrt(q.resolve_axis("head_size").size)
        if self.scale_query:
            q = q * jnp.asarray(scale, q.dtype)
            return hax.dot(q, k, axis="head_size").astype(jnp.float32)
        return hax.dot(q, k, axis="head_size", preferred_element_type=jnp.float32) * scale


class EncoderLayer(eqx.Module):
    attention: SelfAttention
    attn_norm: hnn.LayerNorm
    up: hnn.Linear
    down: hnn.Linear
    mlp_norm: hnn.LayerNorm
    pre_norm: bool = eqx.field(static=True)
    """True: each block's LayerNorm before it (x + f(norm(x))); False: after the residual (norm(x + f(x)))."""
    activation: str = eqx.field(static=True)
    """A key of `ACTIVATIONS`."""

    def __call__(self, x: hax.NamedArray, key_mask: Optional[hax.NamedArray] = None) -> hax.NamedArray:
        """x: [..., position, embed] -> the same; key_mask as `SelfAttention` takes it."""
        if self.pre_norm:
            x = x + self.attention(layer_norm(self.attn_norm, x), key_mask)
            return x + self._mlp(layer_norm(self.mlp_norm, x))
        x = layer_norm(self.attn_norm, x + self.attention(x, key_mask))
        return layer_norm(self.mlp_norm, x + self._mlp(x))

    def _mlp(self, x: hax.NamedArray) -> hax.NamedArray:
        return self.down(ACTIVATIONS[self.activation](self.up(x)))


# ---- loading ----


@dataclasses.dataclass(frozen=True)
class TorchWeights:
    """haliax arrays and modules made of a torch checkpoint's tensors, in `dtype`."""

    tensor: Callable[[str], np.ndarray]
    """A tensor by its checkpoint name; raises for a name the checkpoint lacks."""
    dtype: jnp.dtype

    def array(self, name: str, axes: tuple) -> hax.NamedArray:
        return hax.named(jnp.asarray(self.tensor(name), self.dtype), axes)

    def linear(self, prefix: str, In, Out, weight: Optional[np.ndarray] = None, bias: bool = True) -> hnn.Linear:
        """torch's Linear `prefix` (its .weight kept (out, in)), or `weight` already laid out (in, out);
        with `prefix`.bias unless `bias` is False."""
        weight = self.tensor(f"{prefix}.weight").T if weight is None else weight
        return self._linear(weight, self.tensor(f"{prefix}.bias") if bias else None, In, Out)

    def fused_linear(self, prefixes: tuple[str, ...], In, Out) -> hnn.Linear:
        """torch's Linears `prefixes` of one input as one Linear, their outputs in that order along Out's
        first axis."""
        weight = np.concatenate([self.tensor(f"{p}.weight") for p in prefixes], axis=0).T
        bias = np.concatenate([self.tensor(f"{p}.bias") for p in prefixes], axis=0)
        return self._linear(weight, bias, In, Out)

    def norm(self, prefix: str, axis: hax.Axis, eps: float) -> hnn.LayerNorm:
        return hnn.LayerNorm(axis, self.array(f"{prefix}.weight", (axis,)), self.array(f"{prefix}.bias", (axis,)),
                             eps=eps)

    def _linear(self, weight: np.ndarray, bias: Optional[np.ndarray], In, Out) -> hnn.Linear:
        """weight [in, out] and bias [out], flat, reshaped onto In's and Out's axes."""
        in_shape = tuple(a.size for a in _spec(In))
        out_shape = tuple(a.size for a in _spec(Out))
        named = hax.named(jnp.asarray(weight.reshape(in_shape + out_shape), self.dtype), (*_spec(In), *_spec(Out)))
        if bias is not None:
            bias = hax.named(jnp.asarray(bias.reshape(out_shape), self.dtype), _spec(Out))
        return hnn.Linear(named, bias, In, Out)


@dataclasses.dataclass(frozen=True)
class LayerKeys:
    """Where one encoder layer's weights are in a torch checkpoint: the prefix of each Linear and LayerNorm."""

    query: str
    key: str
    value: str
    out: str
    attn_norm: str
    up: str
    down: str
    mlp_norm: str


def load_encoder_layer(weights: TorchWeights, keys: LayerKeys, sizes: EncoderSizes, *, pre_norm: bool,
                       scale_query: bool) -> EncoderLayer:
    """The layer whose weights `keys` names; `pre_norm` and `scale_query` as EncoderLayer and
    SelfAttention take them."""
    axes = LayerAxes.of(sizes)
    heads = (axes.heads, axes.head_size)
    attention = SelfAttention(
        qkv=weights.fused_linear((keys.query, keys.key, keys.value), axes.embed, (axes.qkv, *heads)),
        out=weights.linear(keys.out, heads, axes.embed),
        scale_query=scale_query,
    )
    return EncoderLayer(
        attention=attention,
        attn_norm=weights.norm(keys.attn_norm, axes.embed, sizes.layer_norm_eps),
        up=weights.linear(keys.up, axes.embed, axes.mlp),
        down=weights.linear(keys.down, axes.mlp, axes.embed),
        mlp_norm=weights.norm(keys.mlp_norm, axes.embed, sizes.layer_norm_eps),
        pre_norm=pre_norm,
        activation=sizes.hidden_act,
    )


def _spec(axes) -> tuple[hax.Axis, ...]:
    return (axes,) if isinstance(axes, hax.Axis) else tuple(axes)
