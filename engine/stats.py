"""What an engine reports about itself for metrics and health. Pure Python."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine for metrics and health."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_pages: int = 0
    num_pages: int = 0
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache."""
    prefix_cache_hits: int = 0
    """Prompt tokens found there."""
    num_preemptions: int = 0
    num_steps: int = 0
    last_batch_size: int = 0
    """Sequences in the most recent step."""
    max_batch_size: int = 0
    """Most sequences ever run in one step."""
    max_model_len: int = 0
    compiled_programs: int = 0
    """Step programs compiled so far (the replica serves from the first; the rest compile in the
    background, and a step takes only compiled ones)."""
    step_programs: int = 0
    """Step programs in all (0: the engine compiles none ahead, e.g. warmup off)."""
    num_adapters: int = 0
    """LoRA adapters known to the engine (read into host memory)."""
    lora_slots_in_use: int = 0
    """Device LoRA slots pinned by running sequences."""
    spec_drafts: int = 0
    """Rows that carried guessed tokens (speculative decoding), since start."""
    spec_draft_tokens: int = 0
    """Guessed tokens checked, since start."""
    spec_accepted_tokens: int = 0
    """Of those, the ones kept (the model sampled the same token)."""

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV pages held by live requests (0 when idle; cached free pages do not count)."""
        return 0.0 if self.num_pages == 0 else 1.0 - self.num_free_pages / self.num_pages
