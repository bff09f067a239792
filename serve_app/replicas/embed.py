"""The embedding-model deployment: one tokenizer and one batched encoder per replica.

The path of one request: the ingress sends a parsed `EmbeddingRequest`; each input becomes token
ids (text with the tokenizer's special tokens, token ids as given); the `AsyncEmbedder` merges
them with whatever other requests are waiting into one batch on its thread; the vectors come back
as floats or base64, with the exact prompt token count as usage.

With `embedding_cache_size`, inputs seen before are answered from the replica's cache
(serve_app.replicas.embedding_cache) and only the others run.

Invariants: everything raised to the caller is an `APIError`; an input that cannot be embedded is
a 400 before anything is queued; `dimensions` only truncates a model trained for it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from pathlib import Path
from typing import Any, Optional

import numpy as np

from engine.config import EngineConfig
from engine.embed.driver import AsyncEmbedder
from serve_app.config import ModelConfig
from serve_app.errors import BadRequest
from serve_app.logs import replica_name
from serve_app.protocol.embeddings import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from serve_app.replicas.base import BatchingReplica, api_errors
from serve_app.replicas.embedding_cache import CacheCollector, EmbeddingCache
from serve_app.tasks import EMBED


class EmbeddingServer(BatchingReplica):
    """One replica of an embedding model: tokenizer + batched encoder + metrics."""

    task = EMBED
    driver_class = AsyncEmbedder
    driver: AsyncEmbedder

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        if self.cache.capacity:
            labels = {"model_name": config.model_id, "replica": replica_name()}
            self.metrics.registry.register(CacheCollector(self.cache, labels))

    def _set_up(self, config: ModelConfig, model_dir: Path, engine_config: EngineConfig, engine: Any) -> None:
        super()._set_up(config, model_dir, engine_config, engine)
        self.cache = EmbeddingCache(config.embedding_cache_size)
        """Vectors of inputs seen before, by their token ids (embedding_cache_size; 0: none)."""
        self.dimensions: int = engine.dimensions
        self._truncatable = matryoshka_dimensions(model_dir)

    def card(self) -> dict[str, Any]:
        return {**super().card(), "dimensions": self.dimensions}

    # ---- called through deployment handles ----

    async def embed(self, request: EmbeddingRequest, arrival_time: float) -> str:
        """The JSON of an embeddings response."""
        with api_errors():
            dimensions = self._dimensions(request.dimensions)
            inputs = await asyncio.to_thread(self._inputs, request.inputs)
            tracker = self.metrics.track(f"embd-{uuid.uuid4().hex}", arrival_time)
            prompt_tokens = sum(map(len, inputs))
            reason = "abort"
            try:
                vectors = await self.cache.embed(inputs, self.driver.embed)
                reason = "stop"
            finally:
                tracker.finish(reason, prompt_tokens, 0, 0)
            vectors = self._truncate(np.asarray(vectors, np.float32), dimensions)
            data = [Embedding(embedding=_encode(v, request.encoding_format), index=i) for i, v in enumerate(vectors)]
            usage = EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
            return EmbeddingResponse(data=data, model=self.model_id, usage=usage).model_dump_json()

    # ---- internals ----

    def _inputs(self, values: list[Any]) -> list[list[int]]:
        """Each input's token ids. Run on a worker thread: tokenizing a large batch must not hold up
        the event loop (the tokenizer releases the GIL)."""
        return [self._input_ids(i, value) for i, value in enumerate(values)]

    def _input_ids(self, index: int, value: Any) -> list[int]:
        if isinstance(value, str) and not value:
            raise BadRequest(f"input[{index}] is an empty string; send some text", "input")
        return self.prompts.prompt(value, "input").ids

    def _dimensions(self, asked: Optional[int]) -> int:
        if asked is None or asked == self.dimensions:
            return self.dimensions
        if asked < self.dimensions and (self._truncatable is True or asked in (self._truncatable or ())):
            return asked
        trained = "" if not self._truncatable else f" (it is trained for {sorted(self._truncatable)})"
        raise BadRequest(f"model {self.model_id!r} makes {self.dimensions}-dimensional embeddings and cannot be "
                         f"truncated to {asked}{trained}; leave dimensions out or set it to {self.dimensions}",
                         "dimensions")

    def _truncate(self, vectors: np.ndarray, dimensions: int) -> np.ndarray:
        """The first `dimensions` of each vector, normalised again if the model normalises."""
        if dimensions == vectors.shape[1]:
            return vectors
        cut = vectors[:, :dimensions]
        if self.driver.describe().get("normalize") == "true":
            cut = cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
        return cut


def matryoshka_dimensions(model_dir: str | Path) -> Any:
    """The sizes a Matryoshka model may be truncated to (config.json's `matryoshka_dimensions`),
    True for any size (`is_matryoshka`), or None: it cannot be truncated."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    if config.get("matryoshka_dimensions"):
        return tuple(config["matryoshka_dimensions"])
    return True if config.get("is_matryoshka") else None


def _encode(vector: np.ndarray, encoding_format: str) -> Any:
    """A list of floats, or base64 of little-endian float32 bytes (OpenAI's `base64`)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
