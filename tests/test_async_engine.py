"""AsyncEngine over the real engine: concurrent streams, and closing or cancelling a stream aborts
its request and returns every KV page."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.core.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.core.request import EngineDeadError, FinishReason, InvalidRequestError, SamplingParams

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(llama_dir):
    async_engine = AsyncEngine(LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=4, page_size=4,
                                                      num_pages=64, max_model_len=128, warmup=False)))
    yield async_engine
    async_engine.shutdown()


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int], params=PARAMS):
    return [delta async for delta in engine.generate(request_id, prompt, params)]


async def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.01)


def all_pages_free(engine: AsyncEngine) -> bool:
    stats = engine.stats()
    return stats.num_running == stats.num_waiting == 0 and stats.num_free_pages == stats.num_pages


def test_concurrent_streams_match_the_step_loop(engine, llama_dir):
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]

    async def run():
        return await asyncio.gather(*(collect(engine, f"c{i}", p) for i, p in enumerate(prompts)))

    streamed = asyncio.run(run())
    reference = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=1, page_size=4, num_pages=64,
                                       max_model_len=128, warmup=False))
    for i, prompt in enumerate(prompts):
        reference.add_request("r", prompt, PARAMS)
        want = []
        while reference.has_work():
            want += [t for d in reference.step() for t in d.token_ids]
        deltas = streamed[i]
        assert [t for d in deltas for t in d.token_ids] == want
        assert deltas[-1].finish_reason is FinishReason.LENGTH
        assert deltas[0].num_prompt_tokens == len(prompt)
    assert all_pages_free(engine)


def test_closing_a_stream_aborts_and_frees_its_pages(engine):
    async def run():
        stream = engine.generate("closed", list(range(20, 40)), SamplingParams(max_tokens=100, ignore_eos=True))
        got = [await stream.__anext__() for _ in range(3)]
        assert engine.stats().num_running == 1
        await stream.aclose()
        await wait_until(lambda: all_pages_free(engine))
        return got

    assert [len(d.token_ids) for d in asyncio.run(run())] == [1, 1, 1]


def test_cancelling_the_consumer_aborts_and_frees_its_pages(engine):
    async def run():
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate("cancelled", list(range(40, 60)),
                                           SamplingParams(max_tokens=100, ignore_eos=True)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: all_pages_free(engine))

    asyncio.run(run())


def test_abort_ends_the_stream_with_an_abort_delta(engine):
    async def run():
        deltas = []
        async for delta in engine.generate("aborted", [3, 4, 5], SamplingParams(max_tokens=100, ignore_eos=True)):
            deltas.append(delta)
            if len(deltas) == 2:
                engine.abort("aborted")
        return deltas

    deltas = asyncio.run(run())
    assert deltas[-1].finish_reason is FinishReason.ABORT and deltas[-1].token_ids == []
    assert all_pages_free(engine)


def test_invalid_requests_raise_before_anything_is_queued(engine):
    async def run():
        with pytest.raises(InvalidRequestError, match="maximum context length is 128"):
            await collect(engine, "long", list(range(3, 103)), SamplingParams(max_tokens=50))

    asyncio.run(run())
    assert all_pages_free(engine)


class _DyingCore:
    """An engine core whose step fails once a request is in: the loop must fail every stream."""

    def __init__(self):
        self.requests = []

    def validate(self, prompt_ids, params):
        pass

    def add_request(self, request_id, prompt_ids, params):
        self.requests.append(request_id)

    def abort(self, request_id):
        pass

    def has_work(self):
        return bool(self.requests)

    def step(self):
        raise RuntimeError("device lost")

    def stats(self):
        from engine.core.request import EngineStats

        return EngineStats()

    def describe(self):
        return {}


def test_a_dead_loop_fails_every_stream_and_refuses_new_ones():
    dying = AsyncEngine(_DyingCore())

    async def run():
        with pytest.raises(EngineDeadError, match="device lost"):
            await collect(dying, "a", [1, 2, 3])
        with pytest.raises(EngineDeadError, match="restart the replica"):
            await collect(dying, "b", [1, 2, 3])

    asyncio.run(run())
    assert not dying.is_alive()
