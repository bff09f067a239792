"""Image inputs in the paged engine: which images' features the devices hold, and the token ids
that stand for them in a prompt. Pure Python.

An image takes `tokens_per_image` prompt positions (LLaVA: one per patch). The runner keeps the
features of up to `slots` images in a device pool of slots x tokens_per_image embedding rows; a
prompt names row r of slot k by the **image token** `vocab_size + (generation x slots + k) x
tokens_per_image + r`, where `generation` counts how often slot k was given to an image. The
forward pass embeds an image token as its pool row ((id - vocab_size) // tokens_per_image % slots,
(id - vocab_size) % tokens_per_image) instead of a vocabulary row; the LM head never samples one.

Invariants: an image's features are written once per slot it is given; a slot is given to another
image only when no running sequence holds it (least recently used first); a slot given again gets
new token ids, so a prefix-cache block written for the old image never matches a prompt of the
new one, while the same image in a follow-up turn (same content hash, slot still held or cached)
gets the same ids: a prefix-cache hit.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import numpy as np

ID_SPACE = 2 ** 31 - 1
"""Token ids are int32: a slot's generation wraps around below this (after 2^31 / (slots x
tokens_per_image) grants of that slot, when blocks cached that long ago are long gone)."""


@dataclasses.dataclass(frozen=True)
class ImageInput:
    """One image of a prompt, as the serving layer prepared it."""

    content_hash: str
    """Of the processed pixels (serve_app.media.images.content_hash): equal images share features and cache."""
    pixels: np.ndarray
    """float32 [3, H, W], the model's preprocessing applied."""


class ImageSlots:
    """The device pool's slots: which image each holds, who holds it, and the ids that name it."""

    def __init__(self, slots: int, tokens_per_image: int, vocab_size: int):
        self.slots, self.tokens_per_image, self.vocab_size = slots, tokens_per_image, vocab_size
        self._of_hash: dict[str, int] = {}
        self._hash_of: list[Optional[str]] = [None] * slots
        self._grants = [0] * slots
        """How often each slot was given to an image (its ids' generation)."""
        self._holders = [0] * slots
        self._unheld: collections.OrderedDict[int, None] = collections.OrderedDict((k, None) for k in range(slots))
        """Slots no sequence holds, least recently released first: the ones to give away."""

    def acquire(self, content_hash: str) -> tuple[int, bool]:
        """(the slot holding this image, whether its features must be written now); held until
        `release`. Raises RuntimeError when every slot is held (callers check `can_acquire`)."""
        slot = self._of_hash.get(content_hash)
        fresh = slot is None
        if fresh:
            if not self._unheld:
                raise RuntimeError(f"all {self.slots} image slots are held by running requests")
            slot = next(iter(self._unheld))
            if self._hash_of[slot] is not None:
                del self._of_hash[self._hash_of[slot]]
            self._hash_of[slot], self._of_hash[content_hash] = content_hash, slot
            self._grants[slot] += 1
        self._holders[slot] += 1
        self._unheld.pop(slot, None)
        return slot, fresh

    def holds(self, content_hash: str) -> bool:
        """Whether a slot has this image's features (held or not)."""
        return content_hash in self._of_hash

    def can_acquire(self, content_hashes: set[str]) -> bool:
        """Whether every one of these images gets a slot now, the ones a slot has first (so no
        image of the set is given away to make room for another of it)."""
        fresh = sum(1 for h in content_hashes if h not in self._of_hash)
        spare = sum(1 for slot in self._unheld if self._hash_of[slot] not in content_hashes)
        return fresh <= spare

    def release(self, slot: int) -> None:
        self._holders[slot] -= 1
        if self._holders[slot] == 0:
            self._unheld[slot] = None  # kept with its features until given away: a later turn may reuse it

    def token_ids(self, slot: int) -> list[int]:
        """The ids standing for the image in slot `slot`, in order."""
        generations = (ID_SPACE - self.vocab_size) // (self.slots * self.tokens_per_image)
        first = ((self._grants[slot] % generations) * self.slots + slot) * self.tokens_per_image
        return [self.vocab_size + first + r for r in range(self.tokens_per_image)]

    def held(self) -> int:
        return sum(1 for h in self._holders if h)


def pool_rows(token_ids: np.ndarray, vocab_size: int, tokens_per_image: int, slots: int) -> np.ndarray:
    """The pool row of each image token (what the device computes; here for tests and planning)."""
    offset = np.asarray(token_ids, np.int64) - vocab_size
    return (offset // tokens_per_image % slots) * tokens_per_image + offset % tokens_per_image
