"""What travels with a request from the ingress to a model server besides the OpenAI request: its
arrival time, its LoRA adapter and its trace context."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional


@dataclasses.dataclass(frozen=True)
class LoraRef:
    """An adapter as a request carries it to a replica."""

    name: str
    path: str

    @property
    def key(self) -> str:
        """The adapter's name in the engine and Ray Serve's multiplexed model id."""
        return f"{self.name}@{hashlib.sha1(self.path.encode()).hexdigest()[:12]}"


@dataclasses.dataclass(frozen=True)
class RequestContext:
    arrival_time: float
    """When the ingress received the request (wall-clock seconds): queue time and TTFT count from it."""
    lora: Optional[LoraRef] = None
    """The LoRA adapter the request names (None: the base model)."""
    trace: dict[str, str] = dataclasses.field(default_factory=dict)
    """The W3C trace context of the ingress's span (empty when tracing is off)."""
