"""The score-model deployment (rerank and score): one tokenizer and one batched cross-encoder per replica.

The path of one request: the ingress sends a parsed `RerankRequest` or `ScoreRequest`; each
(query, document) pair becomes token ids, for a cross-encoder as the tokenizer encodes a pair (with
its special tokens and the token type of each text), for a decoder reranker as its prompt template
(`QWEN3_RERANKER`) lays the two out; the `AsyncScorer` merges them with whatever other requests are
waiting into one batch on its thread; rerank sorts the scores, highest first, score keeps the
request's order. Usage counts every pair's tokens.

Invariants: everything raised to the caller is an `APIError`; a pair that cannot be scored (longer
than the model takes) is a 400 naming the field, before anything is queued.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.score.driver import AsyncScorer, Pair
from serve_app.config import ModelConfig
from serve_app.errors import BadRequest
from serve_app.protocol.score import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    ScoreUsage,
    rerank_json,
)
from serve_app.replicas.base import BatchingReplica, api_errors
from serve_app.tasks import SCORE


@dataclasses.dataclass(frozen=True)
class JudgeTemplate:
    """A decoder reranker's prompt: prefix + the pair's text + suffix, each tokenized alone without
    special tokens (as the model card's reference code does); the model answers next."""

    prefix: str
    pair: str
    """Formatted with `instruction`, `query` and `document`."""
    suffix: str
    instruction: str


QWEN3_RERANKER = JudgeTemplate(
    prefix="<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
           "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n",
    pair="<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}",
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    instruction="Given a web search query, retrieve relevant passages that answer the query",
)
"""Qwen3-Reranker's prompt (its model card's format_instruction, prefix and suffix)."""


class ScoreServer(BatchingReplica):
    """One replica of a score model: tokenizer + batched cross-encoder + metrics."""

    task = SCORE
    driver_class = AsyncScorer
    driver: AsyncScorer

    def _set_up(self, config: ModelConfig, model_dir: Path, engine_config: EngineConfig, engine: Any) -> None:
        super()._set_up(config, model_dir, engine_config, engine)
        self._template = QWEN3_RERANKER if engine.kind == "decoder reranker" else None
        """The prompt a decoder reranker reads its pairs in; None: the tokenizer's pair encoding."""

    # ---- called through deployment handles ----

    async def rerank(self, request: RerankRequest, arrival_time: float) -> str:
        """The JSON of a rerank response."""
        with api_errors():
            pairs = [(request.query, document) for document in request.documents]
            scores, tokens = await self._scores(pairs, ("query", "documents"), arrival_time)
            order = sorted(range(len(scores)), key=lambda i: -scores[i])[: request.top_n]  # stable: ties keep order
            documents = [RerankDocument(text=d) if request.return_documents else None for d in request.documents]
            results = [RerankResult(index=i, relevance_score=scores[i], document=documents[i]) for i in order]
            usage = ScoreUsage(prompt_tokens=tokens, total_tokens=tokens)
            return rerank_json(RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=self.model_id, results=results,
                                              usage=usage))

    async def score(self, request: ScoreRequest, arrival_time: float) -> str:
        """The JSON of a score response."""
        with api_errors():
            scores, tokens = await self._scores(request.pairs, ("text_1", "text_2"), arrival_time)
            data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
            usage = ScoreUsage(prompt_tokens=tokens, total_tokens=tokens)
            return ScoreResponse(id=f"score-{uuid.uuid4().hex}", model=self.model_id, data=data,
                                 usage=usage).model_dump_json()

    # ---- internals ----

    async def _scores(self, texts: list[tuple[str, str]], params: tuple[str, str],
                      arrival_time: float) -> tuple[list[float], int]:
        """Each pair's score and the tokens of all pairs; `params` name the first and second texts' fields."""
        pairs = await asyncio.to_thread(self._pairs, texts, params)
        tokens = sum(len(p.token_ids) for p in pairs)
        tracker = self.metrics.track(f"score-{uuid.uuid4().hex}", arrival_time)
        reason = "abort"
        try:
            scores = await self.driver.score(pairs)
            reason = "stop"
        finally:
            tracker.finish(reason, tokens, 0, 0)
        return [float(s) for s in scores], tokens

    def _pairs(self, texts: list[tuple[str, str]], params: tuple[str, str]) -> list[Pair]:
        """Each pair's token ids, checked against the model's length. Run on a worker thread: the
        tokenizer releases the GIL."""
        pairs = self._encode(texts)
        for i, pair in enumerate(pairs):
            if len(pair.token_ids) > self._max_model_len:
                self._refuse(i, pair, texts[i][0], params)
        return pairs

    def _encode(self, texts: list[tuple[str, str]]) -> list[Pair]:
        hf = self.prompts.hf
        if self._template is None:
            encoded = hf([a for a, _ in texts], [b for _, b in texts], return_token_type_ids=True)
            return [Pair(ids, _first_segment(types)) for ids, types in zip(encoded["input_ids"],
                                                                             encoded["token_type_ids"])]
        t = self._template
        prefix, suffix = (hf(part, add_special_tokens=False)["input_ids"] for part in (t.prefix, t.suffix))
        middles = hf([t.pair.format(instruction=t.instruction, query=a, document=b) for a, b in texts],
                     add_special_tokens=False)["input_ids"]
        return [Pair(ids, len(ids)) for ids in (prefix + middle + suffix for middle in middles)]

    def _refuse(self, i: int, pair: Pair, first: str, params: tuple[str, str]) -> None:
        """The 400 for pair i, longer than the model takes: blame the first text when it leaves no room."""
        alone = len(self._encode([(first, "")])[0].token_ids)
        if alone >= self._max_model_len:
            raise BadRequest(f"This model's maximum context length is {self._max_model_len} tokens. However, "
                             f"{params[0]} alone takes {alone} tokens (with the model's special tokens or template), "
                             f"leaving no room for {params[1]}. Please reduce the length of {params[0]}.", params[0])
        raise BadRequest(f"This model's maximum context length is {self._max_model_len} tokens. However, the pair "
                         f"of {params[1]}[{i}] has {len(pair.token_ids)} tokens. Please reduce the length of the "
                         "input.", params[1])


def _first_segment(types: list[int]) -> int:
    """How many tokens come before the first token of type 1 (all of them when there is none)."""
    return next((i for i, t in enumerate(types) if t), len(types))
