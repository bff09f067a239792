"""A pure-Python LLM engine (following engine.generate.driver's `LLMEngineProtocol`) for serving tests.

Deterministic and easy to predict: a request's i-th output token is its prompt's token at position
(i + shift) mod len(prompt), so the output repeats the prompt. `shift` is 0 for greedy requests
and the seed for sampled ones (a random seed when none is given). A token that is the model's EOS
or one of `stop_token_ids` ends the request with `stop` (once `min_tokens` were made, and unless
`ignore_eos` for EOS); `max_tokens` or the context limit end it with `length`. Logprobs are
made-up but fixed: the chosen token is the most likely, at -0.25 * (1 + i % 3), and its k
alternatives follow at -1, -2, ... below it. Each step advances every running request by one token
(so concurrent requests share steps), and KV "pages" are held as a real engine would hold them.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import random
import threading
import time
from pathlib import Path
from typing import Optional

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.generate.request import (
    FinishReason,
    SamplingParams,
    TokenDelta,
    TokenLogprob,
    check_request,
)
from engine.stats import EngineStats


@dataclasses.dataclass
class _Seq:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    shift: int
    output: list[int] = dataclasses.field(default_factory=list)
    started: bool = False


class FakeEngine:
    step_delay_s: float = 0.0
    """Sleep per step, to make requests last (abort and concurrency tests)."""

    def __init__(self, config: EngineConfig):
        model = json.loads((Path(config.model) / "config.json").read_text())
        eos = model.get("eos_token_id")
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.vocab_size = model["vocab_size"]
        self.max_model_len = config.max_model_len or min(model["max_position_embeddings"], 4096)
        self.max_num_seqs = config.max_num_seqs
        self.page_size = config.page_size
        self.dtype, self.tensor_parallel_size = config.dtype, config.tensor_parallel_size
        self.num_pages = config.num_pages or config.max_num_seqs * math.ceil(self.max_model_len / config.page_size)
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._running: dict[str, _Seq] = {}
        self._aborted: list[str] = []
        self._random = random.Random(config.seed)
        self.aborted: list[str] = []
        """Ids of requests aborted while running or waiting (for tests)."""
        self._steps = self._last_batch = self._max_batch = self._queries = 0
        self._adapters: dict[str, str] = {}

    # ---- LLMEngineProtocol ----

    def validate(self, prompt_ids: list[int], params: SamplingParams, adapter: Optional[str] = None) -> None:
        """The real engine's checks, so that serving tests see its messages."""
        check_request(prompt_ids, params, self.vocab_size, self.max_model_len)
        if adapter is not None and adapter not in self._adapters:
            raise InvalidRequestError(f"LoRA adapter {adapter!r} is not loaded", "model")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    adapter: Optional[str] = None) -> None:
        self.validate(prompt_ids, params, adapter)
        seed = params.seed if params.seed is not None else self._random.randrange(1 << 30)
        shift = 0 if params.greedy else seed
        self._waiting.append(_Seq(request_id, list(prompt_ids), params, shift))

    def add_adapter(self, name: str, path: str) -> None:
        """The real engine's refusal of a directory that is no PEFT adapter; nothing is read."""
        if not (Path(path) / "adapter_config.json").is_file():
            raise ValueError(f"{path} is not a PEFT LoRA adapter: it has no adapter_config.json")
        self._adapters[name] = path

    def remove_adapter(self, name: str) -> bool:
        return self._adapters.pop(name, None) is not None

    def adapters(self) -> list[str]:
        return sorted(self._adapters)

    def abort(self, request_id: str) -> None:
        before = len(self._waiting) + len(self._running)
        self._waiting = collections.deque(s for s in self._waiting if s.request_id != request_id)
        self._running.pop(request_id, None)
        if len(self._waiting) + len(self._running) < before:
            self._aborted.append(request_id)
            self.aborted.append(request_id)

    def step(self) -> list[TokenDelta]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self._admit()
        deltas = [TokenDelta(r, [], finish_reason=FinishReason.ABORT) for r in self._aborted]
        self._aborted = []
        batch = list(self._running.values())
        deltas += [self._advance(seq) for seq in batch]
        self._steps += 1
        self._last_batch = len(batch)
        self._max_batch = max(self._max_batch, self._last_batch)
        return deltas

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._aborted)

    def describe(self) -> dict[str, str]:
        return {"attention_backend": "fake", "dtype": self.dtype,
                "tensor_parallel_size": str(self.tensor_parallel_size), "num_devices": "0",
                "page_size": str(self.page_size), "num_pages": str(self.num_pages)}

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_free_pages=self.num_pages - sum(self._pages(s) for s in self._running.values()),
            num_pages=self.num_pages,
            prefix_cache_queries=self._queries,
            num_steps=self._steps,
            last_batch_size=self._last_batch,
            max_batch_size=self._max_batch,
            max_model_len=self.max_model_len,
        )

    # ---- internals ----

    def _pages(self, seq: _Seq) -> int:
        return math.ceil((len(seq.prompt) + len(seq.output) + 1) / self.page_size)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_num_seqs:
            seq = self._waiting.popleft()
            self._running[seq.request_id] = seq
            self._queries += len(seq.prompt)

    def _next_token(self, seq: _Seq) -> int:
        return seq.prompt[(len(seq.output) + seq.shift) % len(seq.prompt)]

    def _advance(self, seq: _Seq) -> TokenDelta:
        i = len(seq.output)
        token = self._next_token(seq)
        seq.output.append(token)
        delta = TokenDelta(seq.request_id, [token], finish_reason=self._finish_reason(seq, token))
        if seq.params.logprobs is not None:
            delta.logprobs = [_logprob(token, i, seq.params.logprobs, self.vocab_size)]
        if not seq.started:
            seq.started = True
            delta.num_prompt_tokens = len(seq.prompt)
            if seq.params.prompt_logprobs is not None:
                k = seq.params.prompt_logprobs
                delta.prompt_logprobs = [None] + [
                    _logprob(t, j, k, self.vocab_size) for j, t in enumerate(seq.prompt[1:])
                ]
        if delta.finished:
            del self._running[seq.request_id]
        return delta

    def _finish_reason(self, seq: _Seq, token: int) -> Optional[FinishReason]:
        params, made = seq.params, len(seq.output)
        if made >= params.min_tokens and (
            token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos)
        ):
            return FinishReason.STOP
        if made >= params.max_tokens or len(seq.prompt) + made >= self.max_model_len:
            return FinishReason.LENGTH
        return None


def _logprob(token: int, position: int, k: int, vocab_size: int) -> TokenLogprob:
    chosen = -0.25 * (1 + position % 3)
    top = [(token, chosen)] + [((token + j) % vocab_size, chosen - j) for j in range(1, k)]
    return TokenLogprob(token, chosen, tuple(top[:k]))


FIXED_OUTPUT_FILE = "fixed_output.json"


class FixedOutputEngine(FakeEngine):
    """Every request's output is the token ids listed in the checkpoint's `fixed_output.json`
    (repeated if max_tokens asks for more): a model that says exactly what a test needs."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.output = json.loads((Path(config.model) / FIXED_OUTPUT_FILE).read_text())

    def _next_token(self, seq: _Seq) -> int:
        return self.output[len(seq.output) % len(self.output)]


class GatedFakeEngine(FakeEngine):
    """A FakeEngine whose start waits until the file $JAX_SERVE_TEST_GATE exists: a replica that
    stays "starting" for as long as a test needs."""

    def __init__(self, config: EngineConfig):
        gate = Path(os.environ["JAX_SERVE_TEST_GATE"])
        deadline = time.monotonic() + 600
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        super().__init__(config)


class SlowFakeEngine(FakeEngine):
    """Steps take 20 ms, so a long request stays running while a test acts on it."""

    step_delay_s = 0.02


class CrashingFakeEngine(SlowFakeEngine):
    """Its fourth step raises: the engine loop dies mid-request."""

    def step(self) -> list[TokenDelta]:
        if self._steps == 3:
            raise RuntimeError("simulated device failure")
        return super().step()


FAULT_MARK = 301
"""A prompt [FAULT_MARK, FAIL] or [FAULT_MARK, HANG] makes FaultyFakeEngine's next step fail or hang."""
FAIL, HANG = 1, 2


class FaultyFakeEngine(SlowFakeEngine):
    """Fails on command, for the serving tests: a step with a [FAULT_MARK, FAIL] request admitted
    raises (a failed device); one with [FAULT_MARK, HANG] never returns (a hung device)."""

    def step(self) -> list[TokenDelta]:
        prompts = [s.prompt for s in [*self._waiting, *self._running.values()]]
        if [FAULT_MARK, FAIL] in prompts:
            raise RuntimeError("simulated device failure")
        if [FAULT_MARK, HANG] in prompts:
            threading.Event().wait()
        return super().step()
