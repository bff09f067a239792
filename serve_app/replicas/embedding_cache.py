"""An embedding replica's cache of vectors by input, least recently used dropped first.

The key is a digest of the input's token ids (text as the replica's tokenizer encodes it, token ids
as given): within one replica the model, its tokenizer and its engine config are fixed, so the ids
are everything that decides the vector. The model's whole vector is kept (as it normalises it);
`dimensions` and `encoding_format` apply to it afterwards, per request, as to a vector just made.
A request field that changed the model's vector itself would have to join the key.

Each input of a request is looked up once, in order, before the engine runs (a hit, or a miss);
the missing ones run as one batch, an input repeated in it once. Counts are exported as
`jax_serve:embedding_cache_hits` / `_misses` (Prometheus counters) and the entries held as a gauge.
Used on the replica's event loop only.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Awaitable, Callable, Iterable, Optional

import numpy as np
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

Embed = Callable[[list[list[int]]], Awaitable[np.ndarray]]


def input_key(ids: list[int]) -> bytes:
    """A 128-bit digest of token ids (keys stay small whatever the input's length)."""
    return hashlib.blake2b(np.asarray(ids, np.int64).tobytes(), digest_size=16).digest()


class EmbeddingCache:
    """At most `capacity` vectors by `input_key` (0: no cache, every input runs the model)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._vectors: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._vectors)

    async def embed(self, inputs: list[list[int]], embed: Embed) -> np.ndarray:
        """float32 [len(inputs), dimensions]: cached rows for the inputs it holds, `embed` of the
        others (each distinct input once), which it then holds."""
        if not self.capacity:
            return await embed(inputs)
        keys = [input_key(ids) for ids in inputs]
        rows = {key: vector for key in dict.fromkeys(keys) if (vector := self._get(key)) is not None}
        found = [key in rows for key in keys]
        self.hits += sum(found)
        self.misses += len(keys) - sum(found)
        missing: dict[bytes, int] = {}  # each missing input's first index
        for i, key in enumerate(keys):
            if key not in rows:
                missing.setdefault(key, i)
        if missing:
            made = np.asarray(await embed([inputs[i] for i in missing.values()]), np.float32)
            for key, vector in zip(missing, made):
                rows[key] = self._put(key, vector)
        return np.stack([rows[key] for key in keys])

    def _get(self, key: bytes) -> Optional[np.ndarray]:
        vector = self._vectors.get(key)
        if vector is not None:
            self._vectors.move_to_end(key)
        return vector

    def _put(self, key: bytes, vector: np.ndarray) -> np.ndarray:
        vector = vector.copy()
        vector.setflags(write=False)  # shared by every request it answers
        self._vectors[key] = vector
        self._vectors.move_to_end(key)
        while len(self._vectors) > self.capacity:
            self._vectors.popitem(last=False)
        return vector


class CacheCollector:
    """The cache's counts as Prometheus families with the replica's labels, read at each scrape."""

    def __init__(self, cache: EmbeddingCache, labels: dict[str, str]):
        self._cache, self._labels = cache, labels

    def collect(self) -> Iterable[Metric]:
        names, values = list(self._labels), list(self._labels.values())
        counters = {"jax_serve:embedding_cache_hits": ("Embedding inputs answered from the cache.", self._cache.hits),
                    "jax_serve:embedding_cache_misses": ("Embedding inputs not in the cache (the model ran).",
                                                         self._cache.misses)}
        for name, (doc, value) in counters.items():
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            yield family
        entries = GaugeMetricFamily("jax_serve:embedding_cache_entries",
                                    f"Embeddings held in the cache (of {self._cache.capacity}).", labels=names)
        entries.add_metric(values, len(self._cache))
        yield entries
