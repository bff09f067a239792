"""Interleaving several async streams into batches.

A model server runs one engine request per choice (n > 1, batched prompts) and sends their output
over one Ray streaming call. `merge_batches` interleaves the choices' streams and sends at most one
batch per interval (the first at once), so the Ray hops are paid per batch, not per token.
`ChunkPacing` sets that interval for each of a replica's open streams.

Invariant: when the merged stream ends (exhausted, failed, closed or cancelled), every source
stream has been closed, so each engine request still running has been aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Callable, TypeVar, Union

T = TypeVar("T")

_DONE = object()


class ChunkPacing:
    """How often one stream of a replica may send a chunk: the open streams share
    `chunks_per_s`, and no stream sends more often than every `min_interval_s`."""

    def __init__(self, min_interval_s: float, chunks_per_s: float):
        self.min_interval_s = min_interval_s
        self.chunks_per_s = chunks_per_s
        self.open_streams = 0
        """Streams open now (each counted from its `opened()` until it ends)."""

    @contextlib.contextmanager
    def opened(self):
        """Count one stream open while the block runs."""
        self.open_streams += 1
        try:
            yield self
        finally:
            self.open_streams -= 1

    def interval(self) -> float:
        """Seconds between two chunks of one stream, now."""
        return max(self.min_interval_s, self.open_streams / self.chunks_per_s)


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


async def merge_batches(streams: list[AsyncIterator[T]],
                        interval_s: Union[float, Callable[[], float]] = 0.0,
                        flush: Callable[[T], bool] = lambda item: False) -> AsyncIterator[list[T]]:
    """Yield lists of items from all `streams`, in arrival order. The first batch goes as soon as
    an item arrives; each later one no sooner than `interval_s` (a number, or a function read
    after each batch) after the previous, carrying everything that arrived meanwhile, unless an
    item for which `flush` is true arrives (a stream's last output: the client waits on it), or a
    stream ends or fails, which sends the batch at once. A failing stream fails the merged stream,
    after the items that arrived before its failure."""
    interval = interval_s if callable(interval_s) else (lambda: interval_s)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    pumps = [asyncio.create_task(_pump(stream, queue)) for stream in streams]
    open_streams, next_send = len(pumps), loop.time()
    urgent = lambda item: item is _DONE or isinstance(item, _Failed) or flush(item)  # noqa: E731
    try:
        while open_streams:
            items = [await queue.get()]
            while not urgent(items[-1]) and (wait := next_send - loop.time()) > 0:
                try:
                    items.append(await asyncio.wait_for(queue.get(), wait))
                except asyncio.TimeoutError:
                    break
            while not queue.empty():
                items.append(queue.get_nowait())
            batch, failure = [], None
            for item in items:
                if isinstance(item, _Failed):
                    failure = item.exc
                    break
                if item is _DONE:
                    open_streams -= 1
                else:
                    batch.append(item)
            if batch:
                yield batch
                next_send = loop.time() + interval()
            if failure is not None:
                raise failure
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _pump(stream: AsyncIterator[T], queue: asyncio.Queue) -> None:
    try:
        async with contextlib.aclosing(stream):
            async for item in stream:
                queue.put_nowait(item)
    except Exception as exc:
        queue.put_nowait(_Failed(exc))
        return
    queue.put_nowait(_DONE)


async def with_keepalive(batches: AsyncIterator[list[T]], every_s: float) -> AsyncIterator[list[T]]:
    """`batches`, plus an empty batch whenever `every_s` passes without one: a sign of life for a
    reader that must tell a slow stream from a dead one. Closing this closes `batches`."""
    source = aiter(batches)
    pending = asyncio.ensure_future(anext(source))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield []
                continue
            try:
                batch = pending.result()
            except StopAsyncIteration:
                return
            yield batch
            pending = asyncio.ensure_future(anext(source))
    finally:
        if not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await source.aclose()
