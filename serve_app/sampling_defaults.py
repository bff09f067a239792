"""The sampling values a text generation model's requests get when they leave them unset.

A model config's `sampling_defaults` says where they come from: "auto" (the default) takes the
checkpoint's generation_config.json (its temperature, top_p, top_k, min_p, repetition_penalty, as
vLLM's `--generation-config auto` does); "none" keeps OpenAI's (temperature 1, top_p 1, no top_k,
min_p or repetition penalty); a mapping sets those of its values over the checkpoint's.

The replica resolves them (it has the checkpoint's files), applies them to each request
(`SamplingRequest.apply_defaults`: only the fields the request did not send) and reports them to
the ingress for /v1/models. Invariant: the resolved values are all in the engine's ranges, so a
request is never refused for a value it did not send.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

logger = logging.getLogger(__name__)


class SamplingDefaults(BaseModel):
    """Per-model sampling defaults, each in the range a request may send."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    temperature: Optional[float] = Field(None, ge=0.0)
    """0: greedy decoding."""
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)
    """0 or -1: no top-k."""
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0)

    @classmethod
    def parse(cls, values: Mapping[str, Any], where: str = "sampling_defaults") -> "SamplingDefaults":
        """The defaults `values` sets; ValueError naming the key or value to change."""
        unknown = sorted(set(values) - set(cls.model_fields))
        if unknown:
            raise ValueError(f"{where} has no field {unknown[0]!r}; its fields are {', '.join(cls.model_fields)}")
        try:
            return cls.model_validate(dict(values))
        except ValidationError as exc:
            error = exc.errors()[0]
            name = error["loc"][0]
            raise ValueError(f"{where}.{name} = {values[name]!r} is refused ({error['msg']}); change it") from None

    def values(self) -> dict[str, float]:
        """The values it sets (top_k -1 as 0: both mean no top-k)."""
        values = self.model_dump(exclude_none=True)
        if values.get("top_k") == -1:
            values["top_k"] = 0
        return values


SamplingDefaultsSetting = Union[Literal["auto", "none"], SamplingDefaults]


def parse_setting(value: Any) -> Any:
    """A config's `sampling_defaults` as given (also a JSON object from the command line): "auto",
    "none" or a `SamplingDefaults`."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        value = json.loads(value)
    if isinstance(value, Mapping):
        return SamplingDefaults.parse(value)
    if value in ("auto", "none") or isinstance(value, SamplingDefaults):
        return value
    raise ValueError(f"sampling_defaults is {value!r}; set it to auto (the checkpoint's generation_config.json), "
                     "none (OpenAI's) or a mapping such as {temperature: 0.7, top_p: 0.9}")


def effective_defaults(setting: SamplingDefaultsSetting, checkpoint: Mapping[str, Any]) -> dict[str, float]:
    """The defaults a model's requests get: `checkpoint` (generation_config.json's values of
    SamplingDefaults' fields, engine.formats.checkpoint_config.generation_defaults) under `setting`."""
    if setting == "none":
        return {}
    from_checkpoint = _valid(checkpoint)
    if setting == "auto":
        return from_checkpoint
    return {**from_checkpoint, **setting.values()}


def _valid(checkpoint: Mapping[str, Any]) -> dict[str, float]:
    """The checkpoint's values a request may send; each other one is left out with a warning (the
    request then keeps OpenAI's)."""
    values = {}
    for name, value in checkpoint.items():
        try:
            values.update(SamplingDefaults.parse({name: value}, "generation_config.json").values())
        except ValueError as exc:
            logger.warning("%s; requests that leave %s unset keep OpenAI's default (or set sampling_defaults in "
                           "the model's config)", exc, name)
    return values
