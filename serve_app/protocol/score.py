"""/v1/rerank and /v1/score: the requests and the responses.

Rerank is Cohere's and Jina's API as vLLM serves it: a query and documents in, the documents'
relevance scores out, highest first. Score is vLLM's: `text_1` and `text_2` paired one to one (two
lists of one length), or one to many (`text_1` one string, or a list of one). Both score each pair
with the model (a cross-encoder's score of the pair encoded together).
"""

from __future__ import annotations

import time
from typing import Literal, Optional, Union

from pydantic import BaseModel, Field, field_validator, model_validator

from serve_app.protocol.base import OpenAIModel, invalid


class RerankRequest(OpenAIModel):
    """POST /v1/rerank."""

    model: str
    query: str
    documents: list[str]
    """The texts to score against the query (at least one)."""
    top_n: Optional[int] = Field(None, ge=1)
    """Return the n most relevant documents only (default: all of them)."""
    return_documents: bool = True
    """Include each document's text in its result."""

    @field_validator("documents")
    @classmethod
    def _documents(cls, value: list[str]) -> list[str]:
        if not value:
            raise invalid("documents", "documents is empty; send at least one document")
        return value


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    """The document's position in the request's `documents`."""
    relevance_score: float
    document: Optional[RerankDocument] = None
    """With `return_documents` only (left out of the JSON otherwise)."""


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    """Sorted by relevance_score, highest first (ties: the earlier document first)."""
    usage: ScoreUsage


class ScoreRequest(OpenAIModel):
    """POST /v1/score (vLLM's)."""

    model: str
    text_1: Union[str, list[str]]
    """The first text of every pair: one string (or a list of one) for all of them, or one a pair."""
    text_2: Union[str, list[str]]
    """The second text of each pair."""

    @model_validator(mode="after")
    def _paired(self) -> ScoreRequest:
        for name in ("text_1", "text_2"):
            if getattr(self, name) == []:
                raise invalid(name, f"{name} is empty; send a string or a non-empty list of strings")
        firsts, seconds = _as_list(self.text_1), _as_list(self.text_2)
        if len(firsts) > 1 and len(firsts) != len(seconds):
            raise invalid("text_2", f"text_1 holds {len(firsts)} texts and text_2 {len(seconds)}; send lists of "
                                    "one length (one pair each), or one text_1 for every text_2")
        return self

    @property
    def pairs(self) -> list[tuple[str, str]]:
        firsts, seconds = _as_list(self.text_1), _as_list(self.text_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        return list(zip(firsts, seconds))


def _as_list(value: Union[str, list[str]]) -> list[str]:
    return [value] if isinstance(value, str) else value


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    """One a pair, in the request's order."""
    usage: ScoreUsage


def rerank_json(response: RerankResponse) -> str:
    """The response's JSON, without `document` where it was not asked for (nothing else is ever None)."""
    return response.model_dump_json(exclude_none=True)
