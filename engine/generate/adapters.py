"""LoRA adapters in the engine: which are known, and which sit in the devices' slots. Pure Python.

An adapter is known by name (`Adapter`, holding its weights on the host) from when it is added until
it is removed; a request that names it keeps its `Adapter` even if it is removed meanwhile. The
devices hold `max_loras` adapters at once (`AdapterSlots`): a running sequence pins its adapter's
slot; a sequence whose adapter is not in a slot is admitted only when a slot is resident or can be
given to it (an unpinned slot, the least recently used first), and the engine loads the adapter's
weights into that slot before the step that first reads it.

`AdapterRegistry` is the engine's manager of them: the adapters served by name (added and removed
from any thread, one assignment at a time) and the slots the scheduler gives them.

Invariants: a slot holds at most one adapter and an adapter sits in at most one slot; a pinned
slot is never given away; pins are released once per acquire.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import OrderedDict
from typing import Any, Callable, Optional

from engine.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_uids = itertools.count(1)


@dataclasses.dataclass(frozen=True, eq=False)
class Adapter:
    """One loaded adapter. `uid` tells apart two adapters loaded under the same name one after the
    other (the prefix cache and the slots key by it)."""

    name: str
    weights: Any
    """Host-side factors (engine.formats.peft.LoraAdapter), loaded into a slot by the executor."""
    uid: int = dataclasses.field(default_factory=lambda: next(_uids))


class AdapterSlots:
    """Assigns adapters to `num_slots` device slots (0 .. num_slots - 1)."""

    def __init__(self, num_slots: int):
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter uid -> slot, least recently used first
        self._pins = [0] * num_slots
        self._free = list(range(num_slots))

    def can_acquire(self, adapter: Adapter) -> bool:
        return adapter.uid in self._slot_of or bool(self._free) or any(
            self._pins[s] == 0 for s in self._slot_of.values())

    def acquire(self, adapter: Adapter) -> tuple[int, bool]:
        """Pin a slot for `adapter`: (slot, whether its weights must be loaded into it first)."""
        slot = self._slot_of.get(adapter.uid)
        load = slot is None
        if load:
            if not self.can_acquire(adapter):
                raise RuntimeError(f"no LoRA slot for adapter {adapter.name!r}: call can_acquire first")
            slot = self._free.pop(0) if self._free else self._evict()
            self._slot_of[adapter.uid] = slot
        self._slot_of.move_to_end(adapter.uid)
        self._pins[slot] += 1
        return slot, load

    def release(self, adapter: Adapter) -> None:
        slot = self._slot_of.get(adapter.uid)
        if slot is None or self._pins[slot] == 0:
            raise RuntimeError(f"adapter {adapter.name!r} released more often than acquired")
        self._pins[slot] -= 1

    def pinned(self) -> int:
        """Slots held by running sequences."""
        return sum(1 for pins in self._pins if pins)

    def _evict(self) -> int:
        uid = next(uid for uid, slot in self._slot_of.items() if self._pins[slot] == 0)
        return self._slot_of.pop(uid)


class AdapterRegistry:
    """The adapters served by name, and the devices' `max_loras` slots for them (`slots`, None
    when `max_loras` is 0: the engine serves no adapters)."""

    def __init__(self, max_loras: int, read: Callable[[str], Any]):
        """`read(path)`: an adapter's host-side factors (engine.formats.peft.LoraAdapter), or
        ValueError saying why the engine cannot serve it."""
        self.slots = AdapterSlots(max_loras) if max_loras else None
        self._read = read
        self._by_name: dict[str, Adapter] = {}

    def add(self, name: str, path: str) -> None:
        """Read the adapter at `path` and serve it as `name` (replacing an adapter of that name;
        sequences already holding the old one keep it). ValueError if it cannot be served."""
        if self.slots is None:
            raise ValueError("this engine serves no LoRA adapters; set max_loras to the number to hold at once")
        weights = self._read(path)
        self._by_name[name] = Adapter(name, weights)
        logger.info("LoRA adapter %s: rank %d on %s from %s", name, weights.rank, ", ".join(weights.targets), path)

    def remove(self, name: str) -> bool:
        """Stop serving `name` (sequences holding it keep it); False if unknown."""
        return self._by_name.pop(name, None) is not None

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def check(self, name: Optional[str]) -> None:
        """Raise InvalidRequestError unless `name` is None (the base model) or served."""
        if name is not None and name not in self._by_name:
            raise InvalidRequestError(f"LoRA adapter {name!r} is not loaded; loaded: "
                                      f"{', '.join(self.names()) or 'none'}", "model")

    def get(self, name: Optional[str]) -> Optional[Adapter]:
        """The adapter served as `name` (None: the base model)."""
        return None if name is None else self._by_name[name]

    def __len__(self) -> int:
        return len(self._by_name)

    def slots_in_use(self) -> int:
        """Slots pinned by running sequences."""
        return 0 if self.slots is None else self.slots.pinned()
