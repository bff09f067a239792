"""What travels with a request from the ingress to a model server besides the OpenAI request."""

from __future__ import annotations

import dataclasses
from typing import Optional

from serve_app.lora import LoraRef


@dataclasses.dataclass(frozen=True)
class RequestContext:
    arrival_time: float
    """When the ingress received the request (wall-clock seconds): queue time and TTFT count from it."""
    lora: Optional[LoraRef] = None
    """The LoRA adapter the request names (None: the base model)."""
    trace: dict[str, str] = dataclasses.field(default_factory=dict)
    """The W3C trace context of the ingress's span (empty when tracing is off)."""
