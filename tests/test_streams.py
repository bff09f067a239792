"""serve_app.streams.merge_batches: interleaving, batching by window, failures, and closing."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.streams import merge_batches


async def items(values, gate: asyncio.Event | None = None, closed: list | None = None):
    try:
        for value in values:
            if gate is not None:
                await gate.wait()
            yield value
    finally:
        if closed is not None:
            closed.append(values)


async def collect(stream) -> list:
    return [batch async for batch in stream]


def test_merges_every_item_of_every_stream():
    batches = asyncio.run(collect(merge_batches([items([1, 2, 3]), items(["a", "b"])])))
    flat = [x for batch in batches for x in batch]
    assert sorted(flat, key=str) == sorted([1, 2, 3, "a", "b"], key=str)
    assert [x for x in flat if isinstance(x, int)] == [1, 2, 3]  # each stream keeps its order


def test_items_ready_within_the_window_travel_together():
    batches = asyncio.run(collect(merge_batches([items(range(5)), items(range(5, 8))], window_s=0.05)))
    assert sorted(x for batch in batches for x in batch) == list(range(8))
    assert len(batches) == 1


async def failing(values, exc):
    for value in values:
        yield value
    raise exc


def test_a_failure_comes_after_the_items_before_it():
    async def run():
        seen = []
        with pytest.raises(ValueError, match="bad"):
            async for batch in merge_batches([failing([1, 2], ValueError("bad"))]):
                seen += batch
        return seen

    assert asyncio.run(run()) == [1, 2]


def test_closing_the_merged_stream_closes_every_source():
    async def run():
        gate, closed = asyncio.Event(), []
        merged = merge_batches([items([1], closed=closed), items([2, 3], gate, closed)])
        assert await anext(merged) == [1]
        await merged.aclose()
        return closed

    assert sorted(asyncio.run(run()), key=len) == [[1], [2, 3]]
