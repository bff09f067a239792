"""What sets a family's forward pass apart from Llama's, read from config.json as transformers reads
it (levanter's configs drop some of it: Gemma 2's soft-caps, query scale and sliding layers).

- Gemma 2: embeddings scaled by sqrt(hidden_size), attention scores scaled by
  query_pre_attn_scalar ** -0.5 and soft-capped (cap * tanh(s / cap)), the final logits
  soft-capped, every other layer attending over a sliding window (`layer_types`).
- Gemma 3 (text): as Gemma 2 without the soft-caps; five of every six layers slide, and those
  rotate with their own RoPE (`rope_local_base_freq`, unscaled).
- Mistral, Mixtral (and Qwen 2 / 3 with `use_sliding_window`): layers over a sliding window.

A token at position i attends to the keys at positions j with i - window < j <= i in a sliding
layer (transformers' mask), to every earlier key in the others.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import haliax as hax
import jax.numpy as jnp

from engine.layers.rope import Rope

LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_types(hf: dict) -> list[str]:
    """Each layer's attention as transformers builds it: config.json's `layer_types`, else the
    family's rule (Gemma 2: even layers slide; Mistral, Mixtral, Phi-3: every layer, if it has a window;
    Qwen 2 / 3 / 3-MoE with `use_sliding_window`: the layers from `max_window_layers` on)."""
    layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types")
    if kinds is None:
        family, window = hf["model_type"], hf.get("sliding_window")
        if family == "gemma2":
            kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        elif family == "gemma3_text":
            pattern = hf.get("sliding_window_pattern", 6)
            kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        elif family in ("mistral", "mixtral", "phi3") and window is not None:
            kinds = ["sliding_attention"] * layers
        elif family in ("qwen2", "qwen3", "qwen3_moe") and hf.get("use_sliding_window") and window is not None:
            first = hf.get("max_window_layers", 28)
            kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        else:
            kinds = ["full_attention"] * layers
    unknown = sorted(set(kinds) - set(LAYER_TYPES))
    if unknown or len(kinds) != layers:
        raise ValueError(f"config.json's layer_types has {', '.join(unknown) or f'{len(kinds)} entries'}; the engine "
                         f"runs {' and '.join(LAYER_TYPES)} layers, one type per layer")
    return kinds


@dataclasses.dataclass(frozen=True)
class Variant:
    embed_scale: Optional[float] = None
    """The embeddings are multiplied by this (rounded to their dtype, as transformers does)."""
    query_scale: Optional[float] = None
    """The attention scores' scale; None: levanter's (1 / sqrt(head_dim) unless it sets one)."""
    attn_softcap: Optional[float] = None
    """Attention scores become cap * tanh(scores / cap) before the softmax."""
    final_softcap: Optional[float] = None
    """Logits become cap * tanh(logits / cap)."""
    sliding_window: Optional[int] = None
    """Keys a query of a sliding layer sees (itself included); None: no layer slides."""
    sliding_layers: tuple[bool, ...] = ()
    """Per layer: whether it slides."""
    local_rope: Optional[Rope] = None
    """The sliding layers' RoPE where it is not the model's (Gemma 3)."""

    @staticmethod
    def from_hf_config(hf: dict, head_dim: int) -> "Variant":
        """The variant of a config.json (as engine.formats.transformers_files reads it); ValueError
        for layer types the engine does not implement."""
        sliding = tuple(kind == "sliding_attention" for kind in layer_types(hf))
        windows = {"sliding_window": hf["sliding_window"], "sliding_layers": sliding} if any(sliding) else {}
        if hf["model_type"] not in ("gemma2", "gemma3_text"):
            return Variant(**windows)
        if hf["model_type"] == "gemma3_text" and "rope_local_base_freq" in hf:
            local = {"rope_theta": hf["rope_local_base_freq"], "rope_scaling": None}
            windows["local_rope"] = Rope.from_hf_config({**hf, **local}, head_dim)
        scalar = hf.get("query_pre_attn_scalar")
        return Variant(embed_scale=hf["hidden_size"] ** 0.5, query_scale=None if scalar is None else scalar ** -0.5,
                       attn_softcap=hf.get("attn_logit_softcapping"), final_softcap=hf.get("final_logit_softcapping"),
                       **windows)

    def rope_tables(self, index, tables, local_tables):
        """Layer `index`'s (cos, sin): the sliding layers' own where the model has them."""
        if self.local_rope is None:
            return tables
        slides = self.slides(index)
        if isinstance(slides, bool):
            return local_tables if slides else tables
        return tuple(hax.named(jnp.where(slides, local.array, full.array), full.axes)
                     for local, full in zip(local_tables, tables))

    def slides(self, index):
        """Whether layer `index` (an int, or a traced index in a scanned loop) slides."""
        if self.sliding_window is None:
            return False
        if isinstance(index, int):
            return self.sliding_layers[index]
        return jnp.asarray(self.sliding_layers)[index]
