"""The replica template: what every model-server replica does, whatever its task.

A replica starts in one order: it routes its logs, gives the engine's threads their niceness
(before any exists: they inherit it), resolves the checkpoint, loads the tokenizer, builds the
engine (`engine_cls`) and wraps it in its task's async driver (`driver_class`); then the task sets
up what it needs (`_set_up`), and the replica gets its metrics. Every replica answers health,
metrics, /tokenize and /detokenize. A task's replica (serve_app.replicas.generate, .embed,
.transcribe) supplies only what differs: its driver class, `_set_up`, `_engine_stats`,
`max_model_len` and the methods that answer its requests; the replicas over a batching one-device
engine (.embed, .score) share the stats part (`BatchingReplica`).

Invariant: everything a replica raises to its caller is an `APIError` (`api_errors`): it
survives the Ray hop, and its message is meant for the client.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from pathlib import Path
from typing import Any, Iterator

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.formats.model_sources import resolve_model
from engine.stats import EngineStats
from serve_app.config import ModelConfig
from serve_app.errors import to_api_error
from serve_app.logs import replica_name, route_logs_to_replica_log
from serve_app.protocol.admin import DetokenizeRequest, TokenizeRequest
from serve_app.replicas.metrics import ServerMetrics
from serve_app.text.tokenizer import PromptTokenizer
from serve_app.tracing import set_attributes, set_http_status

logger = logging.getLogger(__name__)


class Replica:
    """One model-server replica: its tokenizer (`prompts`), its engine's async `driver` (an
    AsyncEngine, AsyncEmbedder or AsyncTranscriber: `check()` raises EngineDeadError once it
    cannot serve, `error` says why, `describe()`, `shutdown()`) and its `metrics`."""

    task: str
    """Its task's name in serve_app.tasks."""
    driver_class: type
    """The task's async driver, constructed as `driver_class(engine, watchdog_s=...)`."""
    model_id: str
    root: str
    prompts: PromptTokenizer
    driver: Any
    metrics: ServerMetrics

    def __init__(self, config: ModelConfig):
        route_logs_to_replica_log()
        if config.engine_niceness is not None:
            set_thread_niceness(config.engine_niceness)
        model_dir = resolve_model(config.source)
        self.model_id, self.root = config.model_id, config.source.describe()
        self.prompts = PromptTokenizer(str(model_dir), config.model_id)
        engine_config = config.engine_config(model_dir)
        engine = import_engine_class(config.engine_cls)(engine_config)
        self.driver = self.driver_class(engine, watchdog_s=engine_config.step_timeout_s)
        self._set_up(config, model_dir, engine_config, engine)
        description = self.driver.describe()
        self.metrics = ServerMetrics(config.model_id, replica_name(), self._engine_stats, description)
        logger.info("model %s (%s) loaded from %s with %s: %s", self.model_id, self.task, model_dir,
                    config.engine_cls, ", ".join(f"{k}={v}" for k, v in description.items()))

    def _set_up(self, config: ModelConfig, model_dir: Path, engine_config: EngineConfig, engine: Any) -> None:
        """What the task keeps of its config, checkpoint and engine (the driver exists by now)."""

    def _engine_stats(self) -> EngineStats:
        """The engine's latest stats, read at each metrics scrape."""
        raise NotImplementedError

    @property
    def max_model_len(self) -> int:
        raise NotImplementedError

    def card(self) -> dict[str, Any]:
        """What /v1/models shows of the model besides its id, task and state (ModelCard's fields)."""
        return {"max_model_len": self.max_model_len}

    def status(self) -> dict[str, Any]:
        """For the ingress's /health: the driver's own check (a stuck step counts as dead), and how
        many of its step programs are compiled (it serves from the first); for /v1/models, its `card`."""
        stats = self.metrics.stats()
        programs = {"compiled_programs": stats.compiled_programs, "step_programs": stats.step_programs,
                    "card": self.card()}
        try:
            self.driver.check()
        except EngineDeadError:
            return {"model": self.model_id, "alive": False, "error": repr(self.driver.error), **programs}
        return {"model": self.model_id, "alive": True, "error": None, **programs}

    def check_health(self) -> None:
        """Ray Serve's periodic probe: a replica whose engine died, or whose step is stuck past the
        watchdog, fails it and is restarted (its requests have already been failed)."""
        try:
            self.driver.check()
        except EngineDeadError as exc:
            raise RuntimeError(f"the {self.task} engine of {self.model_id} is dead: {exc}") from None

    def metric_families(self) -> list:
        return self.metrics.families()

    def tokenize(self, request: TokenizeRequest) -> str:
        with api_errors():
            return self.prompts.tokenize(request, self.max_model_len).model_dump_json()

    def detokenize(self, request: DetokenizeRequest) -> str:
        with api_errors():
            return self.prompts.detokenize(request).model_dump_json()

    def __del__(self):
        try:
            driver = self.driver
        except AttributeError:  # construction failed before the driver existed
            return
        driver.shutdown()


class BatchingReplica(Replica):
    """A replica over a one-device engine that batches whole requests (embed, score): its stats are
    the engine's length limit and compile progress. A subclass's `_set_up` calls this one first."""

    def _set_up(self, config: ModelConfig, model_dir: Path, engine_config: EngineConfig, engine: Any) -> None:
        self._max_model_len: int = engine.max_model_len
        self._compile_progress = engine.compile_progress

    def _engine_stats(self) -> EngineStats:
        compiled, programs = self._compile_progress()
        return EngineStats(max_model_len=self._max_model_len, compiled_programs=compiled, step_programs=programs)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len


@contextlib.contextmanager
def api_errors(span: Any = None) -> Iterator[None]:
    """Let only `APIError`s out: anything else raised inside becomes the APIError for it (its
    traceback dropped), recorded on the request's `span` when it has one."""
    try:
        yield
    except Exception as exc:
        error = to_api_error(exc)
        set_attributes(span, **{"error.type": type(error).__name__})
        set_http_status(span, error.status)
        raise error from None


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
