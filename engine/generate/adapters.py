"""LoRA adapters in the engine: which are known, and which sit in the devices' slots. Pure Python.

An adapter is known by name (`Adapter`, holding its weights on the host) from when it is added until
it is removed; a request that names it keeps its `Adapter` even if it is removed meanwhile. The
devices hold `max_loras` adapters at once (`AdapterSlots`): a running sequence pins its adapter's
slot; a sequence whose adapter is not in a slot is admitted only when a slot is resident or can be
given to it (an unpinned slot, the least recently used first), and the engine loads the adapter's
weights into that slot before the step that first reads it.

Invariants: a slot holds at most one adapter and an adapter sits in at most one slot; a pinned
slot is never given away; pins are released once per acquire.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from typing import Any

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
