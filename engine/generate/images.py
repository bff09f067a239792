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

`ImageAdmission` is the engine's manager of requests with images: it checks that a prompt places
its images, gives each request's images slots before the request is queued for the scheduler
(computing the features of an image no slot has), and while running requests hold the slots a
request needs, holds it back (first come, first served) until the step after they end.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from engine.errors import InvalidRequestError

if TYPE_CHECKING:  # names for annotations only: the serving layer imports ImageInput from here
    from engine.generate.request import SamplingParams
    from engine.generate.scheduler import Sequence

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


class ImageAdmission:
    """Requests with images on their way to the scheduler, and the image slots they hold. A
    text-only model (`layout` None) takes no images: it admits nothing and holds no slots."""

    def __init__(self, layout: Optional[tuple[int, int, int]], vocab_size: int,
                 add_image: Callable[[int, Any], None]):
        """`layout`: (placeholder token id, tokens per image, image slots); `add_image(slot,
        pixels)` computes an image's features into a slot on the devices."""
        self.image_token_id: Optional[int] = None if layout is None else layout[0]
        """The prompt's image placeholder token (a model that takes images), else None."""
        self.slots = None if layout is None else ImageSlots(layout[2], layout[1], vocab_size)
        """Which image each device slot holds, or None: a text-only model."""
        self._add_image = add_image
        self._awaiting: dict[str, tuple[Sequence, tuple[ImageInput, ...]]] = {}
        """Requests waiting for image slots (in arrival order), not yet scheduled."""

    @property
    def num_waiting(self) -> int:
        return len(self._awaiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._awaiting

    def check(self, prompt_ids: list[int], params: SamplingParams, images: tuple[ImageInput, ...]) -> None:
        """Raise InvalidRequestError unless the prompt places exactly these images and the
        model can take them all at once."""
        if self.slots is None:
            if images:
                raise InvalidRequestError("this model takes no images; send text only, or serve a vision-language "
                                          "model", "messages")
            return
        runs = _placeholder_runs(prompt_ids, self.image_token_id)
        n = self.slots.tokens_per_image
        if len(runs) != len(images) or any(length != n for _, length in runs):
            raise InvalidRequestError(f"the prompt places {len(runs)} images ({[length for _, length in runs]} "
                                      f"placeholder tokens) but the request sends {len(images)}, each taking {n}",
                                      "messages")
        if len({image.content_hash for image in images}) > self.slots.slots:
            raise InvalidRequestError(f"the request sends more distinct images than the {self.slots.slots} this "
                                      "server holds at once; send fewer, or raise image_slots", "messages")
        if images and params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt logprobs are not computed for prompts with images; leave them out",
                                      "prompt_logprobs")

    def submit(self, seq: Sequence, images: tuple[ImageInput, ...]) -> None:
        """Hold a checked request back until its images get slots (`admit`)."""
        self._awaiting[seq.request_id] = (seq, images)

    def withdraw(self, request_id: str) -> bool:
        """Drop a request still waiting for slots; False if none waits under this id."""
        return self._awaiting.pop(request_id, None) is not None

    def admit(self) -> list[Sequence]:
        """The waiting requests whose images all get slots now, their prompts' placeholders
        replaced with their images' tokens, first come first served: one waits while running
        requests hold the slots it needs, and those behind it wait too."""
        admitted = []
        while self._awaiting:
            request_id, (seq, images) = next(iter(self._awaiting.items()))
            if not self.slots.can_acquire({image.content_hash for image in images}):
                break
            del self._awaiting[request_id]
            seq.image_slots = self._place(seq.prompt_ids, images)
            admitted.append(seq)
        return admitted

    def release(self, seq: Sequence) -> None:
        """A sequence is done (finished or aborted): the slots its images held go back."""
        for slot in seq.image_slots:
            self.slots.release(slot)
        seq.image_slots = []

    def _place(self, prompt: list[int], images: tuple[ImageInput, ...]) -> list[int]:
        """Hold a slot for each image (the ones a slot has first; `can_acquire` said they fit),
        computing the features of an image no slot has, and replace each image's placeholders in
        `prompt` with its image tokens; the slots held, one per image."""
        slots = [-1] * len(images)
        for i in sorted(range(len(images)), key=lambda i: not self.slots.holds(images[i].content_hash)):
            slots[i], fresh = self.slots.acquire(images[i].content_hash)
            if fresh:
                self._add_image(slots[i], images[i].pixels)
        for (start, length), slot in zip(_placeholder_runs(prompt, self.image_token_id), slots):
            prompt[start: start + length] = self.slots.token_ids(slot)
        return slots


def _placeholder_runs(prompt: list[int], token: Optional[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of `token` in `prompt`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(prompt):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs

