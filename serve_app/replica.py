"""What every model-server replica answers, whatever its task: health, metrics, /tokenize and
/detokenize. `ModelServer` (text, serve_app.server) and `EmbeddingServer` (embeddings,
serve_app.embedding_server) build on it."""

from __future__ import annotations

from typing import Any

from engine.core.request import EngineDeadError
from serve_app.errors import to_api_error
from serve_app.metrics import ServerMetrics
from serve_app.protocol import DetokenizeRequest, TokenizeRequest
from serve_app.tokenizer import PromptTokenizer


class Replica:
    """The common surface of a replica over its `core` (an AsyncEngine or AsyncEmbedder: `check()`
    raises EngineDeadError once it cannot serve, `error` says why, `shutdown()`), its tokenizer
    (`prompts`) and its `metrics`."""

    task: str
    model_id: str
    prompts: PromptTokenizer
    metrics: ServerMetrics

    @property
    def core(self) -> Any:
        raise NotImplementedError

    @property
    def max_model_len(self) -> int:
        raise NotImplementedError

    def status(self) -> dict[str, Any]:
        """For the ingress's /health: the core's own check (a stuck step counts as dead)."""
        try:
            self.core.check()
        except EngineDeadError:
            return {"model": self.model_id, "alive": False, "error": repr(self.core.error)}
        return {"model": self.model_id, "alive": True, "error": None}

    def check_health(self) -> None:
        """Ray Serve's periodic probe: a replica whose core died, or whose step is stuck past the
        watchdog, fails it and is restarted (its requests have already been failed)."""
        try:
            self.core.check()
        except EngineDeadError as exc:
            raise RuntimeError(f"the {self.task} engine of {self.model_id} is dead: {exc}") from None

    def metric_families(self) -> list:
        return self.metrics.families()

    def tokenize(self, request: TokenizeRequest) -> str:
        try:
            return self.prompts.tokenize(request, self.max_model_len).model_dump_json()
        except Exception as exc:
            raise to_api_error(exc) from None

    def detokenize(self, request: DetokenizeRequest) -> str:
        try:
            return self.prompts.detokenize(request).model_dump_json()
        except Exception as exc:
            raise to_api_error(exc) from None

    def __del__(self):
        try:
            core = self.core
        except AttributeError:  # construction failed before the core existed
            return
        core.shutdown()
