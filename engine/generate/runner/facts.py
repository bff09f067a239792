"""What a loaded runner tells the engine to plan with: one frozen object, made once by the
`ModelRunner`, handed up unchanged by the executors (over Ray from a multi-host replica's worker 0)
and read by `LLMEngine`. Plain data that pickles; nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

from engine.formats.checkpoint_config import ModelInfo
from engine.step.buckets import ShapeBuckets


class ImageLayout(NamedTuple):
    """How a model that takes images holds them on the devices."""

    image_token_id: int
    """The token id of the prompt's image placeholders."""
    tokens_per_image: int
    slots: int
    """Images the device pool holds at once."""


@dataclasses.dataclass(frozen=True)
class RunnerFacts:
    """A runner's sizes, fixed from the end of its start to its end (every host's runner has the same)."""

    buckets: ShapeBuckets
    """The step shapes the runner compiles and runs."""
    num_pages: int
    """KV pages of the pool (page 0 is the scratch page)."""
    max_model_len: int
    """Tokens per sequence the replica serves."""
    info: ModelInfo
    """The checkpoint's sizes and EOS ids."""
    lora_targets: tuple[str, ...]
    """The projections LoRA adapters may adapt (empty: the runner holds no adapter slots)."""
    flat_step_tokens: int
    """Tokens a step holds at about the cost of one (the attention backend's answer)."""
    image_layout: Optional[ImageLayout]
    """How images are held, for a model that takes them; else None."""
    description: dict[str, str]
    """How the model runs (backend, dtypes, devices, mesh, KV pool): logged at start, an info
    metric's labels."""

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.info.eos_token_ids
