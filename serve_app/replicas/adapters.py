"""LoRA adapters in a model-server replica: which adapters it holds in host memory.

A replica (`ReplicaAdapters`) reads an adapter on first use and keeps at most `max_cpu_loras` in
host memory, least recently used leaving first (in a Serve replica through Ray Serve's model
multiplexing, which also tells the router what it holds); which of them sit on the devices is the
engine's business (engine.generate.adapters). The key names the path too, so an adapter loaded again
from another path under the same name is another adapter: requests running with the old one keep it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable

from ray import serve
from ray.serve.exceptions import RayServeException

from serve_app.errors import BadRequest
from serve_app.protocol.context import LoraRef

logger = logging.getLogger(__name__)


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
    try:
        serve.get_replica_context()
    except RayServeException:
        return None

    async def held(key: str) -> _Held:  # a plain function: the multiplexer keeps its state on it
        return await load(key)

    return serve.multiplexed(max_num_models_per_replica=max_loaded)(held)
