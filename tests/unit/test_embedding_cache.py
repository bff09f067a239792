"""serve_app.replicas.embedding_cache: hits skip the model, misses run as one batch (each distinct
input once), least recently used out first, counts exported with the replica's labels."""

from __future__ import annotations

import asyncio

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

from serve_app.replicas.embedding_cache import CacheCollector, EmbeddingCache


class Model:
    """A stand-in embedder: input ids -> [sum, length, first id], recording every batch it runs."""

    def __init__(self):
        self.batches: list[list[list[int]]] = []

    async def __call__(self, inputs: list[list[int]]) -> np.ndarray:
        self.batches.append(inputs)
        return np.array([[sum(ids), len(ids), ids[0]] for ids in inputs], np.float32)


def embed(cache: EmbeddingCache, model: Model, *inputs: list[int]) -> np.ndarray:
    return asyncio.run(cache.embed(list(inputs), model))


def test_hits_skip_the_model_and_return_the_same_vectors():
    cache, model = EmbeddingCache(4), Model()
    first = embed(cache, model, [1, 2], [3], [1, 2])
    assert model.batches == [[[1, 2], [3]]]  # the repeated input ran once
    assert first.tolist() == [[3, 2, 1], [3, 1, 3], [3, 2, 1]] and first.dtype == np.float32
    assert (cache.hits, cache.misses, len(cache)) == (0, 3, 2)
    again = embed(cache, model, [3], [4, 5], [1, 2])
    assert model.batches[1:] == [[[4, 5]]]
    assert again.tolist() == [[3, 1, 3], [9, 2, 4], [3, 2, 1]]
    assert (cache.hits, cache.misses, len(cache)) == (2, 4, 3)


def test_the_least_recently_used_input_goes_first():
    cache, model = EmbeddingCache(2), Model()
    embed(cache, model, [1], [2])
    embed(cache, model, [1])  # [2] is now the least recently used
    embed(cache, model, [3])  # evicts [2]
    embed(cache, model, [1], [2])
    assert model.batches == [[[1], [2]], [[3]], [[2]]]
    assert (cache.hits, cache.misses, len(cache)) == (2, 4, 2)
    embed(cache, model, [3])  # evicted by [2]: [1] was used after [3]
    assert model.batches[-1] == [[3]]


def test_a_batch_larger_than_the_cache_keeps_its_last_inputs():
    cache, model = EmbeddingCache(2), Model()
    assert embed(cache, model, [1], [2], [3])[:, 0].tolist() == [1, 2, 3]
    embed(cache, model, [2], [3], [1])
    assert model.batches == [[[1], [2], [3]], [[1]]]


def test_size_zero_is_no_cache():
    cache, model = EmbeddingCache(0), Model()
    embed(cache, model, [1], [1])
    embed(cache, model, [1])
    assert model.batches == [[[1], [1]], [[1]]]
    assert (cache.hits, cache.misses, len(cache)) == (0, 0, 0)


def test_cached_vectors_cannot_be_changed_by_a_caller():
    cache, model = EmbeddingCache(2), Model()
    embed(cache, model, [7])[0, 0] = -1.0
    assert embed(cache, model, [7]).tolist() == [[7, 1, 7]]


def test_counts_are_prometheus_counters_with_the_replicas_labels():
    cache, model = EmbeddingCache(3), Model()
    embed(cache, model, [1], [1], [2])
    embed(cache, model, [2])
    registry = CollectorRegistry()
    registry.register(CacheCollector(cache, {"model_name": "m", "replica": "r"}))
    lines = [line for line in generate_latest(registry).decode().splitlines() if not line.startswith("#")]
    assert lines == ['jax_serve:embedding_cache_hits_total{model_name="m",replica="r"} 1.0',
                     'jax_serve:embedding_cache_misses_total{model_name="m",replica="r"} 3.0',
                     'jax_serve:embedding_cache_entries{model_name="m",replica="r"} 2.0']
