"""LoRA adapters in the serving layer: which names the ingress routes to which base model, and
which adapters a replica holds in host memory.

A client selects an adapter by sending its name as `model` (vLLM's convention). The ingress keeps
the routes (`AdapterRoutes`): those of each model's `lora_modules`, and those added or removed at
run time through `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (held by the ingress replica
that received them). A request for an adapter goes to its base model's deployment with a
`LoraRef` and Ray Serve's `multiplexed_model_id` set to the ref's key, so the router prefers the
replicas that already hold it.

A replica (`ReplicaAdapters`) reads an adapter on first use and keeps at most `max_cpu_loras` in
host memory, least recently used leaving first (in a Serve replica through Ray Serve's model
multiplexing, which also tells the router what it holds); which of them sit on the devices is the
engine's business (engine.core.adapters). The key names the path too, so an adapter loaded again
from another path under the same name is another adapter: requests running with the old one keep it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import threading
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable, Optional

from serve_app.errors import BadRequest, NotFound

logger = logging.getLogger(__name__)


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


class ReplicaAdapters:
    """The adapters one replica holds in host memory (see the module docstring). `add(key, path)`
    and `remove(key)` are the engine's (blocking: `add` reads the adapter).

    A request leases its adapter from before the engine sees it until it ends: an adapter evicted
    meanwhile leaves the engine when its last lease ends (requests already running keep their
    adapter anyway; a lease covers the moment before the engine has taken the request)."""

    def __init__(self, add: Callable[[str, str], None], remove: Callable[[str], Any], max_loaded: int):
        self._add, self._remove, self._max_loaded = add, remove, max_loaded
        self._paths: dict[str, str] = {}
        self._local: OrderedDict[str, _Held] = OrderedDict()
        self._lock = asyncio.Lock()
        self._leases: dict[str, int] = {}
        self._evicted: set[str] = set()
        self._books = threading.Lock()  # leases and evictions: Serve's multiplexer evicts on another thread
        self._multiplexed = _multiplexed(self._load, max_loaded)

    @contextlib.asynccontextmanager
    async def lease(self, ref: LoraRef, param: str = "model") -> AsyncIterator[str]:
        """Hold `ref` (reading it first if this replica does not); yields its engine name.
        BadRequest naming `param` if the engine cannot serve it (the engine's reason)."""
        try:
            key = await self._use(ref)
        except ValueError as exc:
            raise BadRequest(f"LoRA adapter {ref.name!r}: {exc}", param) from None
        with self._books:
            self._leases[key] = self._leases.get(key, 0) + 1
        try:
            yield key
        finally:
            with self._books:
                self._leases[key] -= 1
                gone = False
                if not self._leases[key]:
                    del self._leases[key]
                    gone = key in self._evicted
                    self._evicted.discard(key)
            if gone:
                self._remove(key)

    async def _use(self, ref: LoraRef) -> str:
        self._paths[ref.key] = ref.path
        if self._multiplexed is not None:
            await self._multiplexed(ref.key)
            return ref.key
        async with self._lock:  # outside Ray Serve: the same LRU, kept here
            if ref.key in self._local:
                self._local.move_to_end(ref.key)
                return ref.key
            if len(self._local) >= self._max_loaded:
                self._local.popitem(last=False)[1].release()
            self._local[ref.key] = await self._load(ref.key)
        return ref.key

    async def _load(self, key: str) -> "_Held":
        path = self._paths[key]
        with self._books:
            self._evicted.discard(key)
        await asyncio.get_running_loop().run_in_executor(None, self._add, key, path)
        logger.info("LoRA adapter %s read from %s", key, path)
        return _Held(key, self._evict)

    def _evict(self, key: str) -> None:
        with self._books:
            leased = key in self._leases
            if leased:
                self._evicted.add(key)
        if not leased:
            self._remove(key)


class _Held:
    """One adapter held by a replica; `release` (Ray Serve's multiplexer calls `__del__` when it
    evicts) lets it go once."""

    def __init__(self, key: str, evict: Callable[[str], None]):
        self._key, self._evict, self._released = key, evict, False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._evict(self._key)

    def __del__(self):
        self.release()


def _multiplexed(load, max_loaded: int):
    """`load` behind Ray Serve's model multiplexing in a Serve replica; None elsewhere."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        serve.get_replica_context()
    except RayServeException:
        return None

    async def held(key: str) -> _Held:  # a plain function: the multiplexer keeps its state on it
        return await load(key)

    return serve.multiplexed(max_num_models_per_replica=max_loaded)(held)
