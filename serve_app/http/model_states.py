"""Whether each model can take requests: ready, starting, or failed to start (and why).

A model's replicas may still be starting (loading, compiling), retrying after a failed start, or
given up on by Serve (a constructor that failed three times in a row: a bad checkpoint, a config
error). The ingress asks Serve's controller (`serve.status()`, off the event loop, every
`interval_s` from its start, and again before refusing a request) and turns each model's
deployment into a `ModelState`, so that a request for a model
that cannot serve gets a 503 saying why at once, instead of waiting in Serve's queue or being
dropped; /health and /v1/models report the same states. The ingress watches the states from its
start (`watch`), so a model whose start fails is logged once, as one line with the replica's own
error, at its first failed try and again when Serve gives up: `serve run` shows both in its output
(and then stops the whole app, Serve's rule for an app that failed to deploy; `serve deploy` keeps
the other models serving).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from typing import Callable, Literal, Optional

from ray import serve

logger = logging.getLogger(__name__)

State = Literal["ready", "starting", "failed"]


@dataclasses.dataclass(frozen=True)
class ModelState:
    state: State
    reason: Optional[str] = None
    """Failed: the replica's error in one line. Starting: the last failed start's, while Serve retries."""

    def problem(self, model_id: str) -> Optional[str]:
        """Why `model_id` cannot take a request now, or None when it can."""
        if self.state == "ready":
            return None
        if self.state == "failed":
            return f"model {model_id!r} failed to start: {self.reason}; fix its configuration and redeploy"
        retrying = f" (retrying after: {self.reason})" if self.reason else ""
        return f"model {model_id!r} is starting (loading and compiling){retrying}; retry shortly"

    def log_line(self, model_id: str) -> Optional[str]:
        """What the ingress logs once when a model's start fails, or None."""
        if self.state == "failed":
            return (f"model {model_id!r} failed to start and Serve gave up: {self.reason}; fix its configuration "
                    "and redeploy")
        if self.reason:
            return (f"model {model_id!r} failed to start: {self.reason}; Serve retries it (a checkpoint or config "
                    "error fails again: fix the model's entry)")
        return None


READY = ModelState("ready")


@dataclasses.dataclass(frozen=True)
class DeploymentView:
    """What Serve says of one deployment."""

    status: str
    """DeploymentStatus' value: UPDATING, HEALTHY, UNHEALTHY, DEPLOY_FAILED, ..."""
    message: str
    running_replicas: int


def state_of(view: Optional[DeploymentView]) -> ModelState:
    """A deployment with a running replica is ready; one Serve gave up on (DEPLOY_FAILED) has
    failed; anything else is starting."""
    if view is None:
        return ModelState("starting")
    if view.running_replicas > 0:
        return READY
    reason = replica_error(view.message)
    if view.status == "DEPLOY_FAILED":
        return ModelState("failed", reason or "its replicas could not start (see the Serve controller's log)")
    return ModelState("starting", reason)  # also a deployment whose replicas are being replaced


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Exit|Interrupt)): ?(.*)$")


def replica_error(message: str) -> Optional[str]:
    """The replica's own exception in one line ("ValueError: ...") from Serve's message about a
    failed start, whose traceback ends with it; None when the message holds none."""
    lines = [_ANSI.sub("", line).strip() for line in message.splitlines()]
    errors = [m for m in map(_ERROR_LINE.match, lines) if m]
    if not errors:
        return None
    name, text = errors[-1].groups()
    return f"{name}: {text}" if text else name


Fetch = Callable[[], dict[str, DeploymentView]]
"""Serve's view of the application's deployments, by deployment name (blocking)."""


def serve_status(app_name: str) -> dict[str, DeploymentView]:
    """Every deployment of `app_name`, as Serve's controller sees it now."""
    app = serve.status().applications.get(app_name)
    if app is None:
        return {}
    return {name: DeploymentView(str(d.status.value), d.message or "", d.replica_states.get("RUNNING", 0))
            for name, d in app.deployments.items()}


class ModelStates:
    """Each model's state, kept fresh by `watch` (every `interval_s`). Serve's controller is never
    on a ready model's request path: only a model that is not ready is asked about again."""

    def __init__(self, deployments: dict[str, str], fetch: Fetch, interval_s: float = 1.0, timeout_s: float = 5.0):
        """`deployments`: model id -> its deployment's name."""
        self._deployments = deployments
        self._fetch = fetch
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._states: dict[str, ModelState] = {}
        self._fetched_at = float("-inf")
        """When the last answer was asked for (time.monotonic())."""
        self._lock = asyncio.Lock()
        self._reported: dict[str, Optional[str]] = {}

    async def get(self, model_id: str) -> ModelState:
        """The model's state. One that was not ready (or never asked about) is asked of Serve again
        as of this call, since it may have just started: a request is never refused on an old
        answer (concurrent calls share one question)."""
        state = self._states.get(model_id)
        if state is not None and state.state == "ready":
            return state
        return (await self.refresh(since=time.monotonic())).get(model_id, READY)

    async def all(self) -> dict[str, ModelState]:
        """Every model's state, as last asked (asked now if never)."""
        if not self._states:
            await self.refresh(since=time.monotonic())
        return {m: self._states.get(m, READY) for m in self._deployments}

    async def refresh(self, since: Optional[float] = None) -> dict[str, ModelState]:
        """Ask Serve now, unless an answer asked for after `since` is in. Without an answer (the
        controller restarting, or slow past `timeout_s`) the states stay as they were; a model never
        answered for counts as ready, and Serve routes its requests as it would."""
        async with self._lock:
            if since is None or self._fetched_at < since:
                asked = time.monotonic()
                try:
                    fetch = asyncio.get_running_loop().run_in_executor(None, self._fetch)
                    views = await asyncio.wait_for(fetch, self._timeout_s)
                except Exception as exc:  # noqa: BLE001 -- keep serving on the last answer
                    logger.warning("could not read the models' states from Serve (%r); keeping the last ones", exc)
                else:
                    self._states = {m: state_of(views.get(d)) for m, d in self._deployments.items()}
                    self._fetched_at = asked
                    self._report()
            return dict(self._states)

    async def watch(self) -> None:
        """Refresh the states every interval, for as long as the ingress runs (it logs failures)."""
        while True:
            await self.refresh()
            await asyncio.sleep(self._interval_s)

    def _report(self) -> None:
        """Log each failed start once (the first failed try, and Serve giving up)."""
        for model_id, state in self._states.items():
            line = state.log_line(model_id)
            if line is not None and self._reported.get(model_id) != line:
                logger.error("%s", line)
                self._reported[model_id] = line
