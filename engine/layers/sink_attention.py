"""Attention with learned sinks (gpt-oss): levanter's attention module plus one logit per query head
that joins each query's softmax over its keys and carries no value, so a head can attend to
"nothing" (engine.backends.base.LayerAttention.sinks says how every backend computes it)."""

from __future__ import annotations

import dataclasses

import haliax as hax
from haliax import NamedArray
from levanter.layers.attention import Attention, AttentionConfig


class SinkAttention(Attention):
    """levanter's `Attention` with `sinks` (kv_head, q_heads_per_group): query head h = kv_head * G + g
    has the sink logit sinks[kv_head, g], as a checkpoint's per-head vector reshaped."""

    sinks: NamedArray | None = None

    @staticmethod
    def init(config: AttentionConfig, *, key) -> "SinkAttention":
        attention = Attention.init(config, key=key)
        fields = {f.name: getattr(attention, f.name) for f in dataclasses.fields(attention)}
        return SinkAttention(**fields, sinks=hax.zeros((config.KVHeads, config.QHeadsPerGroup)))
