"""What every model-server replica answers, whatever its task: health, metrics, /tokenize and
/detokenize. `ModelServer` (text, serve_app.replicas.generate) and `EmbeddingServer` (embeddings,
serve_app.replicas.embed) build on it."""

from __future__ import annotations

import importlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from serve_app.config import ModelConfig
from serve_app.errors import to_api_error
from serve_app.logs import route_logs_to_replica_log
from serve_app.protocol.admin import DetokenizeRequest, TokenizeRequest
from serve_app.replicas.metrics import ServerMetrics
from serve_app.text.tokenizer import PromptTokenizer

logger = logging.getLogger(__name__)



class Replica:
    """The common surface of a replica over its `core` (an AsyncEngine or AsyncEmbedder: `check()`
    raises EngineDeadError once it cannot serve, `error` says why, `shutdown()`), its tokenizer
    (`prompts`) and its `metrics`."""

    task: str
    model_id: str
    root: str
    prompts: PromptTokenizer
    metrics: ServerMetrics

    def _start(self, config: ModelConfig) -> tuple[Path, EngineConfig, Any]:
        """What every replica does first: route its logs, give the engine's threads their niceness
        (before any exists: they inherit it), resolve the checkpoint, load the tokenizer, build the
        engine core. Returns (checkpoint directory, engine config, engine core)."""
        from engine.formats.model_sources import resolve_model

        route_logs_to_replica_log()
        if config.engine_niceness is not None:
            set_thread_niceness(config.engine_niceness)
        model_dir = resolve_model(config.source)
        self.model_id, self.root = config.model_id, config.source.describe()
        self.prompts = PromptTokenizer(str(model_dir), config.model_id)
        engine_config = config.engine_config(model_dir)
        return model_dir, engine_config, import_engine_class(config.engine_cls)(engine_config)

    @property
    def core(self) -> Any:
        raise NotImplementedError

    @property
    def max_model_len(self) -> int:
        raise NotImplementedError

    def status(self) -> dict[str, Any]:
        """For the ingress's /health: the core's own check (a stuck step counts as dead), and how
        many of its step programs are compiled (it serves from the first)."""
        stats = self.metrics.stats()
        programs = {"compiled_programs": stats.compiled_programs, "step_programs": stats.step_programs}
        try:
            self.core.check()
        except EngineDeadError:
            return {"model": self.model_id, "alive": False, "error": repr(self.core.error), **programs}
        return {"model": self.model_id, "alive": True, "error": None, **programs}

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


def set_thread_niceness(value: int) -> None:
    """Give the calling thread, and every thread it starts from now on, niceness `value` (Linux
    niceness is per thread). Logs a warning when not permitted."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), value)
    except (PermissionError, AttributeError, OSError) as exc:
        logger.warning("cannot set the engine's niceness to %d (%s); start Ray with RAY_worker_niceness=%d "
                       "or set engine_niceness: null", value, exc, value)


def import_engine_class(path: str) -> type:
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"engine_cls {path!r} cannot be imported ({exc}); set engine_cls to 'module:Class'") from exc

