"""serve_app.text.streams.merge_batches: interleaving, batching by window, failures, and closing.

The timing tests run on virtual time (tests/support/virtual_clock.py): sleeps take no real time, and each
batch's contents and timestamp are exact on every machine."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.text.streams import merge_batches
from tests.support import virtual_clock


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


async def spaced(values, every_s: float):
    for value in values:
        yield value
        await asyncio.sleep(every_s)


async def timed_batches(streams, **kwargs) -> list[tuple[float, list]]:
    """(virtual time, batch) for each batch of merge_batches(streams, **kwargs)."""
    loop = asyncio.get_running_loop()
    return [(round(loop.time(), 6), batch) async for batch in merge_batches(streams, **kwargs)]


def test_first_item_goes_at_once_then_one_batch_per_interval_until_the_end():
    """Items every 0.03 s, a 0.15 s interval: the first alone at once, then what arrived in each
    window, and the stream's end sends what is left at once, not a window later."""
    batches = virtual_clock.run(timed_batches([spaced(range(12), 0.03)], interval_s=0.15))
    assert batches == [(0.0, [0]), (0.15, [1, 2, 3, 4, 5]), (0.3, [6, 7, 8, 9, 10]), (0.36, [11])]


def test_a_flush_item_goes_without_waiting_for_the_interval():
    """A stream's last output (here: "end") is sent as soon as it arrives, with what came before it
    in the window; the interval (10 s) would otherwise hold it back."""
    batches = virtual_clock.run(timed_batches([spaced([0, 1, 2, "end"], 0.02)], interval_s=10.0,
                                              flush=lambda item: item == "end"))
    assert batches == [(0.0, [0]), (0.06, [1, 2, "end"])]


def test_without_an_interval_items_ready_together_travel_together():
    batches = asyncio.run(collect(merge_batches([items(range(5)), items(range(5, 8))])))
    assert sorted(x for batch in batches for x in batch) == list(range(8))


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


def test_the_interval_may_be_a_function_read_after_each_batch():
    """A zero interval sends the next item alone; then one batch per 0.2 s."""
    intervals = iter([0.0, 0.2, 0.2, 0.2])
    batches = virtual_clock.run(timed_batches([spaced(range(6), 0.03)], interval_s=lambda: next(intervals)))
    assert batches == [(0.0, [0]), (0.03, [1]), (0.18, [2, 3, 4, 5])]


def test_with_keepalive_sends_an_empty_batch_for_each_silent_period():
    from serve_app.text.streams import with_keepalive

    async def slow():
        await asyncio.sleep(0.1)
        yield [1]
        await asyncio.sleep(12)
        yield [2]

    async def run():
        loop = asyncio.get_running_loop()
        return [(round(loop.time(), 6), batch) async for batch in with_keepalive(slow(), every_s=5)]

    assert virtual_clock.run(run()) == [(0.1, [1]), (5.1, []), (10.1, []), (12.1, [2])]


def test_closing_the_keepalive_stream_closes_its_source():
    from serve_app.text.streams import with_keepalive

    async def run():
        closed = []
        stream = with_keepalive(items([[1], [2]], asyncio.Event(), closed), every_s=5)  # the gate never opens
        assert await anext(stream) == []
        await stream.aclose()
        return closed

    assert virtual_clock.run(run()) == [[[1], [2]]]
