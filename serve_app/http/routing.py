"""Cache-aware routing: a request goes to the model-server replica most likely to hold its prompt's
prefix in its KV cache (Ray Serve's request-router API; it runs in the ingress, beside the handle).

Each replica's history is a bounded set of prefix hashes of the prompts routed to it: the prompt's
text (a chat's messages with their roles, a completion's prompt) cut into `CHUNK`-character
chunks, hash i covering every chunk up to the i-th (as the engine keys its KV pages by token
prefix). A request goes to the candidate whose history holds the most of its leading chunks, when
that is at least one chunk and that replica's queue is not `imbalance` requests longer than the
shortest known; if it refuses (full), or none matches, the least loaded of two random replicas
(Ray Serve's default) takes it. A request for a LoRA adapter first narrows the candidates to the
replicas that hold the adapter (Serve's multiplexing). Each ingress replica learns from its own
traffic; the history is not shared between them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable, Optional

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    FIFOMixin,
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

CHUNK = 64
"""Characters per prefix chunk: about 16 tokens, the engine's default page."""
MAX_CHUNKS = 512
"""Leading chunks of a prompt that count (32k characters): longer prompts match on these."""
HISTORY = 100_000
"""Prefix hashes remembered per replica, least recently routed forgotten first."""


def prompt_text(request: Any) -> Optional[str]:
    """The text a request's prompt starts with, as the prefix history keys it (a batch: its first
    prompt; token ids as their decimal text); None for requests without a prompt."""
    messages = getattr(request, "messages", None)
    if messages is not None:  # each message's content is text (ChatMessage joins text parts)
        return "".join(f"<|{m.role}|>{m.content}" for m in messages)
    prompts = getattr(request, "prompts", None)
    if not prompts:
        return None
    return prompts[0] if isinstance(prompts[0], str) else " ".join(str(t) for t in prompts[0])


def prefix_hashes(text: str) -> list[int]:
    """One chained hash per full `CHUNK` of `text` (at most MAX_CHUNKS)."""
    hashes, parent = [], 0
    for end in range(CHUNK, min(len(text), CHUNK * MAX_CHUNKS) + 1, CHUNK):
        parent = hash((parent, text[end - CHUNK : end]))
        hashes.append(parent)
    return hashes


class PrefixHistory:
    """Which prefix hashes were routed to which replica (by replica id; bounded per replica, LRU)."""

    def __init__(self, capacity: int = HISTORY):
        self.capacity = capacity
        self._seen: dict[Any, OrderedDict[int, None]] = {}

    def match(self, hashes: list[int], replicas: Iterable[Any]) -> tuple[Optional[Any], int]:
        """(the replica id holding the most leading hashes, how many); (None, 0) if none holds
        one. Ties go to the first replica given."""
        best, longest = None, 0
        for replica in replicas:
            seen = self._seen.get(replica, {})
            held = next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
            if held > longest:
                best, longest = replica, held
        return best, longest

    def add(self, replica: Any, hashes: list[int]) -> None:
        seen = self._seen.setdefault(replica, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def forget(self, replica: Any) -> None:
        self._seen.pop(replica, None)

    def keep_only(self, replicas: Iterable[Any]) -> None:
        """Forget every replica not in `replicas` (scaled down, replaced)."""
        for replica in set(self._seen) - set(replicas):
            del self._seen[replica]


class PrefixAffinityRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    """See the module docstring. `imbalance`: how many more queued requests than the least loaded
    replica the prefix's replica may have and still be preferred."""

    def initialize_state(self, imbalance: int = 4, history: int = HISTORY):
        self._imbalance = imbalance
        self._history = PrefixHistory(history)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        fallback = await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        hashes = _hashes_of(pending_request)
        if not hashes or not fallback:
            return fallback
        allowed = (self.apply_multiplex_routing(pending_request) if pending_request.metadata.multiplexed_model_id
                   else {r.replica_id for r in candidate_replicas})
        candidates = {r.replica_id: r for r in candidate_replicas if r.replica_id in allowed}
        best, _ = self._history.match(hashes, candidates)
        if best is None or self._overloaded(best, list(candidates)):
            return fallback
        return [[candidates[best]], *fallback]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        hashes = _hashes_of(pending_request)
        if hashes:
            self._history.add(replica_id, hashes)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self._history.forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]):
        super().update_replicas(replicas)
        self._history.keep_only(r.replica_id for r in replicas)

    def _overloaded(self, replica: ReplicaID, candidates: list[ReplicaID]) -> bool:
        """Whether `replica`'s known queue is `imbalance` longer than the shortest known one."""
        cache = self.replica_queue_len_cache
        known = {r: q for r in candidates if (q := cache.get(r)) is not None}
        return replica in known and known[replica] - min(known.values()) > self._imbalance


def _hashes_of(pending_request: Optional[PendingRequest]) -> list[int]:
    if pending_request is None or not pending_request.args:
        return []
    text = prompt_text(pending_request.args[0])
    return prefix_hashes(text) if text else []
