"""LoRA adapters in the ingress: which names route to which base model.

A client selects an adapter by sending its name as `model` (vLLM's convention). The ingress keeps
the routes (`AdapterRoutes`): those of each model's `lora_modules`, and those added or removed at
run time through `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (held by the ingress replica
that received them). A request for an adapter goes to its base model's deployment with a
`LoraRef` and Ray Serve's `multiplexed_model_id` set to the ref's key, so the router prefers the
replicas that already hold it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from serve_app.errors import BadRequest, NotFound
from serve_app.protocol.context import LoraRef


@dataclasses.dataclass(frozen=True)
class AdapterRoute:
    base: str
    """The model id of the base model."""
    ref: LoraRef


class AdapterRoutes:
    """Adapter names -> their base model and path, for one ingress replica."""

    def __init__(self, static: dict[str, dict[str, str]], models: list[str]):
        """`static`: each base model's `lora_modules`; `models`: every served model id (an adapter
        may not take a model's name)."""
        self._models = set(models)
        self._routes: dict[str, AdapterRoute] = {}
        for base, modules in static.items():
            for name, path in modules.items():
                self.add(base, name, path)

    def get(self, name: str) -> Optional[AdapterRoute]:
        return self._routes.get(name)

    def routes(self) -> list[AdapterRoute]:
        return list(self._routes.values())

    def check(self, name: str, replace: bool = False) -> None:
        """Raise BadRequest if `name` cannot be given to an adapter (a model's name, or an
        adapter's unless `replace`)."""
        if name in self._models:
            raise BadRequest(f"{name!r} is the name of a served model; give the adapter another name", "lora_name")
        if name in self._routes and not replace:
            raise BadRequest(f"the LoRA adapter {name!r} is already loaded; unload it first or send "
                             "load_inplace: true", "lora_name")

    def add(self, base: str, name: str, path: str, replace: bool = False) -> AdapterRoute:
        self.check(name, replace)
        route = AdapterRoute(base, LoraRef(name, path))
        self._routes[name] = route
        return route

    def remove(self, name: str) -> AdapterRoute:
        route = self._routes.pop(name, None)
        if route is None:
            raise NotFound(f"the LoRA adapter {name!r} cannot be found", "lora_name")
        return route
