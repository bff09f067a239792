"""What one ingress serves, as its routes see it: each model's backend, the LoRA adapters' routes,
and the limits and tracing every request gets. `create_app` keeps one `Served` on the app's state;
a route reads it with `served(raw)`."""

from __future__ import annotations

import dataclasses
from typing import Optional

from fastapi import Request
from pydantic import BaseModel

from serve_app.config import RequestLimits
from serve_app.errors import BadRequest, NotFound
from serve_app.http.adapter_routes import AdapterRoutes
from serve_app.http.backends import ModelBackend
from serve_app.http.metrics import HttpResponses
from serve_app.protocol.context import LoraRef
from serve_app.tasks import TASKS, task_of
from serve_app.tracing import Tracing


@dataclasses.dataclass
class Served:
    """The models one ingress serves and how it serves them."""

    backends: dict[str, ModelBackend]
    """Each model's backend, by model id."""
    adapters: AdapterRoutes
    """The LoRA adapters' names -> their base model."""
    limits: RequestLimits
    tracing: Tracing
    responses: HttpResponses
    """The ingress's own count of its responses (/metrics)."""

    def resolve(self, name: str) -> tuple[str, Optional[LoraRef]]:
        """The model a request's `model` names, and the adapter's ref when it names a LoRA adapter."""
        route = self.adapters.get(name)
        return (route.base, route.ref) if route else (name, None)

    def backend(self, model_id: str, request_cls: type[BaseModel]) -> ModelBackend:
        """The backend of `model_id`, if it serves requests of this kind (else a 404 or a 400)."""
        if model_id not in self.backends:
            raise self.unknown_model(model_id)
        backend, task = self.backends[model_id], task_of(request_cls)
        if task is not None and backend.task != task.name:
            served = TASKS[backend.task]
            raise BadRequest(f"model {model_id!r} is {served.what}; send this request to {served.routes_text()}",
                             "model")
        return backend

    def unknown_model(self, model_id: str) -> NotFound:
        adapters = sorted(r.ref.name for r in self.adapters.routes())
        also = f"; LoRA adapters: {adapters}" if adapters else ""
        return NotFound(f"the model {model_id!r} does not exist; served models: {sorted(self.backends)}{also}",
                        "model")

    def lora_base(self, name: Optional[str]) -> str:
        """The model a loaded adapter adapts: `name`, or the only text generation model."""
        generating = sorted(model_id for model_id, b in self.backends.items() if TASKS[b.task].lora)
        if name is None and len(generating) == 1:
            return generating[0]
        if name is None:
            raise BadRequest(f"this server serves several text generation models ({', '.join(generating)}); say "
                             "which the adapter adapts in base_model_name", "base_model_name")
        if name not in generating:
            raise BadRequest(f"base_model_name {name!r} is not a text generation model served here; served: "
                             f"{', '.join(generating)}", "base_model_name")
        return name


def served(raw: Request) -> Served:
    """What the app of this request serves."""
    return raw.app.state.served
