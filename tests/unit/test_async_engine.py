"""AsyncEngine over the real engine: concurrent streams, and closing or cancelling a stream aborts
its request and returns every KV page."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidRequestError
from engine.generate.driver import AsyncEngine
from engine.generate.engine import LLMEngine
from engine.generate.request import FinishReason, SamplingParams
from engine.stats import EngineStats

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def driver(llama_dir):
    async_engine = AsyncEngine(LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=4, page_size=4,
                                                      num_pages=64, max_model_len=128, warmup=False)))
    yield async_engine
    async_engine.shutdown()


async def collect(driver: AsyncEngine, request_id: str, prompt: list[int], params=PARAMS):
    return [delta async for delta in driver.generate(request_id, prompt, params)]


async def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.01)


def all_pages_free(driver: AsyncEngine) -> bool:
    stats = driver.stats()
    return stats.num_running == stats.num_waiting == 0 and stats.num_free_pages == stats.num_pages


def test_concurrent_streams_match_the_step_loop(driver, llama_dir):
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]

    async def run():
        return await asyncio.gather(*(collect(driver, f"c{i}", p) for i, p in enumerate(prompts)))

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
    assert all_pages_free(driver)


def test_closing_a_stream_aborts_and_frees_its_pages(driver):
    async def run():
        stream = driver.generate("closed", list(range(20, 40)), SamplingParams(max_tokens=100, ignore_eos=True))
        got = [await stream.__anext__() for _ in range(3)]
        assert driver.stats().num_running == 1
        await stream.aclose()
        await wait_until(lambda: all_pages_free(driver))
        return got

    assert [len(d.token_ids) for d in asyncio.run(run())] == [1, 1, 1]


def test_cancelling_the_consumer_aborts_and_frees_its_pages(driver):
    async def run():
        started = asyncio.Event()

        async def consume():
            async for _ in driver.generate("cancelled", list(range(40, 60)),
                                           SamplingParams(max_tokens=100, ignore_eos=True)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: all_pages_free(driver))

    asyncio.run(run())



def test_a_consumer_whose_event_loop_closes_is_aborted_and_the_loop_serves_on(driver):
    """The caller's event loop closes while its stream is open and unclosed (its generator's
    `finally` never runs): the engine loop drops the stream, aborts the request, and lives."""
    loop = asyncio.new_event_loop()
    stream = driver.generate("orphan", list(range(60, 80)), SamplingParams(max_tokens=100, ignore_eos=True))
    first = loop.run_until_complete(anext(stream))
    loop.close()
    assert len(first.token_ids) == 1

    async def after():
        await wait_until(lambda: all_pages_free(driver))
        return await collect(driver, "after", [5, 6, 7])

    assert [len(d.token_ids) for d in asyncio.run(after())] == [1] * PARAMS.max_tokens
    del stream  # its finalizer cannot run on the closed loop; keep it until the test is done
def test_abort_ends_the_stream_with_an_abort_delta(driver):
    async def run():
        deltas = []
        async for delta in driver.generate("aborted", [3, 4, 5], SamplingParams(max_tokens=100, ignore_eos=True)):
            deltas.append(delta)
            if len(deltas) == 2:
                driver.abort("aborted")
        return deltas

    deltas = asyncio.run(run())
    assert deltas[-1].finish_reason is FinishReason.ABORT and deltas[-1].token_ids == []
    assert all_pages_free(driver)


def test_invalid_requests_raise_before_anything_is_queued(driver, monkeypatch):
    """The refusal comes from validate() in the caller's thread: the engine never sees the request,
    and a request running beside it is unharmed."""
    added = []
    add_request = driver.engine.add_request
    monkeypatch.setattr(driver.engine, "add_request", lambda rid, *args: (added.append(rid), add_request(rid, *args)))

    async def run():
        beside = asyncio.ensure_future(collect(driver, "beside", [5, 6, 7]))
        with pytest.raises(InvalidRequestError, match="maximum context length is 128"):
            await collect(driver, "long", list(range(3, 103)), SamplingParams(max_tokens=50))
        return await beside

    deltas = asyncio.run(run())
    assert added == ["beside"]
    assert sum(len(d.token_ids) for d in deltas) == PARAMS.max_tokens
    assert deltas[-1].finish_reason is FinishReason.LENGTH
    assert all_pages_free(driver)


class _DyingEngine:
    """An engine whose step fails once a request is in: the loop must fail every stream."""

    def __init__(self):
        self.requests = []

    def validate(self, prompt_ids, params, adapter=None):
        pass

    def add_request(self, request_id, prompt_ids, params, adapter=None):
        self.requests.append(request_id)

    def abort(self, request_id):
        pass

    def has_work(self):
        return bool(self.requests)

    def step(self):
        raise RuntimeError("device lost")

    def stats(self):
        return EngineStats()

    def describe(self):
        return {}


def test_a_dead_loop_fails_every_stream_and_refuses_new_ones():
    dying = AsyncEngine(_DyingEngine())

    async def run():
        with pytest.raises(EngineDeadError, match="device lost"):
            await collect(dying, "a", [1, 2, 3])
        with pytest.raises(EngineDeadError, match="restart the replica"):
            await collect(dying, "b", [1, 2, 3])

    asyncio.run(run())
    assert not dying.is_alive()


class _StuckEngine(_DyingEngine):
    """An engine whose step blocks until the test releases it: a hung device."""

    def __init__(self):
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def step(self):
        self.entered.set()
        self.release.wait()
        return []


def test_a_step_past_the_watchdog_fails_its_streams_and_the_health_check():
    fake = _StuckEngine()
    stuck = AsyncEngine(fake, watchdog_s=0.2)

    async def run():
        stream = asyncio.ensure_future(collect(stuck, "a", [1, 2, 3]))
        await asyncio.get_running_loop().run_in_executor(None, fake.entered.wait)
        stuck.check()  # the step has only just begun
        await wait_until(lambda: not _passes(stuck.check))  # the step is held: past 0.2 s the check fails
        with pytest.raises(EngineDeadError, match="has not returned for"):
            await asyncio.wait_for(stream, 10)  # the stream ended without the step returning
        with pytest.raises(EngineDeadError, match="restart the replica"):
            await collect(stuck, "b", [1, 2, 3])

    try:
        asyncio.run(run())
        assert not stuck.is_alive()
    finally:
        fake.release.set()
        stuck.shutdown()


def _passes(check) -> bool:
    try:
        check()
    except EngineDeadError:
        return False
    return True


class _DiesDuringValidation(_DyingEngine):
    """validate() of request "late" waits until the loop has died (of request "first"): the
    request then registers its stream after every stream was failed."""

    def __init__(self):
        super().__init__()
        self.driver = None

    def validate(self, prompt_ids, params, adapter=None):
        if prompt_ids == [9]:
            deadline = time.monotonic() + 30
            while self.driver.is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)


def test_a_request_arriving_as_the_engine_dies_gets_an_error_not_a_hang():
    fake = _DiesDuringValidation()
    driver = fake.driver = AsyncEngine(fake)

    async def run():
        first = asyncio.ensure_future(collect(driver, "first", [1, 2, 3]))
        with pytest.raises(EngineDeadError, match="device lost"):
            await asyncio.wait_for(collect(driver, "late", [9]), 10)
        with pytest.raises(EngineDeadError, match="device lost"):
            await first

    asyncio.run(run())


def test_shutdown_fails_running_streams_and_later_requests():
    fake = _StuckEngine()
    driver = AsyncEngine(fake)

    async def run():
        stream = asyncio.ensure_future(collect(driver, "a", [1, 2, 3]))
        await asyncio.get_running_loop().run_in_executor(None, fake.entered.wait)
        driver.shutdown(timeout_s=0)  # the loop is stuck in a step: it cannot be joined
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(stream, 10)
        with pytest.raises(EngineDeadError, match="shut down"):
            await collect(driver, "b", [1, 2, 3])

    try:
        asyncio.run(run())
    finally:
        fake.release.set()


def test_shutdown_ends_open_streams_with_an_error_and_frees_every_page(llama_dir):
    """Four streams mid-generation when the engine shuts down: each ends with EngineDeadError (a
    client sees an error event, not a silent end) and the engine holds no request and no page."""
    driver = AsyncEngine(LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=4, page_size=4, num_pages=64,
                                                max_model_len=128, warmup=False)))
    long = SamplingParams(max_tokens=100, ignore_eos=True)

    async def run():
        streams = [driver.generate(f"s{i}", [5 + i, 6, 7], long) for i in range(4)]
        for stream in streams:
            await anext(stream)  # every request is running
        driver.shutdown()
        for stream in streams:
            with pytest.raises(EngineDeadError, match="shut down"):
                async for _ in stream:
                    pass

    asyncio.run(run())
    assert all_pages_free(driver)
