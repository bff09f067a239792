"""The task registry: for each task a model can serve, its replica, its default engine, the
requests and routes it answers and what it supports. The ingress, the app builder and the config
read it, so a new task is one entry here (and its replica, engine and routes).

Classes are named by import path (`module:Class`): the ingress never imports a replica's module,
and nothing here imports jax or transformers.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Optional

from pydantic import BaseModel

from engine.tasks import EMBED, GENERATE, SCORE, TASK_NAMES, TRANSCRIBE
from serve_app.protocol.audio import TranscriptionRequest, TranslationRequest
from serve_app.protocol.chat import ChatCompletionRequest
from serve_app.protocol.completions import CompletionRequest
from serve_app.protocol.embeddings import EmbeddingRequest
from serve_app.protocol.score import RerankRequest, ScoreRequest

__all__ = ["DEFAULT_TASK", "EMBED", "GENERATE", "SCORE", "TASKS", "TASK_NAMES", "TRANSCRIBE", "Task", "task_of"]


@dataclasses.dataclass(frozen=True)
class Task:
    """What one task serves and how."""

    name: str
    replica: str
    """The replica class (`module:Class`), constructed on each model-server replica."""
    engine: str
    """The default `engine_cls` (`module:Class`), imported on the replica."""
    deployment: str
    """The prefix of its models' deployment names (`<deployment>-<model_id>`)."""
    what: str
    """What its model is called in an error ("a text generation model")."""
    requests: tuple[type[BaseModel], ...]
    """The request types it answers (besides /tokenize and /detokenize, which every task does)."""
    routes: tuple[str, ...]
    """Where those requests go."""
    model_types: frozenset[str] = frozenset()
    """config.json model types it serves (auto-detected from a local checkpoint)."""
    marker_files: tuple[str, ...] = ()
    """Files whose presence in a local checkpoint says it serves this task (sentence-transformers'
    modules.json)."""
    lora: bool = False
    """Whether its models take LoRA adapters."""
    tracing: bool = False
    """Whether its replica traces requests (it is constructed with the app's TracingConfig)."""
    prefix_routing: bool = False
    """Whether the prefix-affinity request router applies (its requests reuse cached prompt prefixes)."""

    def replica_class(self) -> type:
        """The replica class (imports its module, which the app builder and a replica may; the ingress never does)."""
        module, _, name = self.replica.partition(":")
        return getattr(importlib.import_module(module), name)

    def routes_text(self) -> str:
        return " or ".join(self.routes)


TASKS: dict[str, Task] = {task.name: task for task in (
    Task(GENERATE, "serve_app.replicas.generate:TextServer", "engine.generate.engine:LLMEngine", "TextServer",
         "a text generation model", (CompletionRequest, ChatCompletionRequest),
         ("/v1/completions", "/v1/chat/completions"), lora=True, tracing=True, prefix_routing=True),
    Task(EMBED, "serve_app.replicas.embed:EmbeddingServer", "engine.embed.engine:EmbeddingEngine", "EmbeddingServer",
         "an embedding model", (EmbeddingRequest,), ("/v1/embeddings",),
         model_types=frozenset({"bert", "xlm-roberta"}), marker_files=("modules.json",)),
    Task(TRANSCRIBE, "serve_app.replicas.transcribe:SpeechServer", "engine.transcribe.engine:SpeechEngine",
         "SpeechServer", "a speech-to-text model", (TranscriptionRequest, TranslationRequest),
         ("/v1/audio/transcriptions", "/v1/audio/translations"), model_types=frozenset({"whisper"})),
    Task(SCORE, "serve_app.replicas.score:ScoreServer", "engine.score.engine:ScoreEngine", "ScoreServer",
         "a score (rerank) model", (RerankRequest, ScoreRequest), ("/v1/rerank", "/v1/score")),
)}
"""Every task, in the order auto-detection tries them (the first whose marker file or model type matches)."""
DEFAULT_TASK = GENERATE
"""What a model serves when nothing says otherwise."""


def task_of(request_cls: type[BaseModel]) -> Optional[Task]:
    """The task that answers requests of this type (None: every task does, e.g. /tokenize)."""
    return next((task for task in TASKS.values() if request_cls in task.requests), None)
