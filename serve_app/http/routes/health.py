"""/health (each model's state, its live replicas and its compile progress; a 503 while one is not
ready) and /metrics (every replica's metrics and the ingress's own, in Prometheus' text format).
Neither needs the API key."""

from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from serve_app.errors import Unavailable
from serve_app.http.backends import ModelBackend
from serve_app.http.metrics import render
from serve_app.http.schema import ERRORS
from serve_app.http.served import served

HEALTHY = {"type": "object", "required": ["status", "models"], "properties": {
    "status": {"const": "ok"},
    "models": {"type": "object", "description": "Per model: its state, its live replicas and, once it compiles step "
               "programs ahead of use, the fewest any replica has compiled and how many there are (a replica "
               "serves from the first; the rest compile in the background). A 503 lists every model's state "
               "(ready, starting or failed, with the error) beside the error.",
               "additionalProperties": {"type": "object", "required": ["state"], "properties": {
                   "state": {"enum": ["ready", "starting", "failed"]}, "error": {"type": ["string", "null"]},
                   "replicas": {"type": "integer"}, "compiled_programs": {"type": "integer"},
                   "step_programs": {"type": "integer"}}}}}}

router = APIRouter()


@router.get("/health", responses={200: {"content": {"application/json": {"schema": HEALTHY}}}, **ERRORS})
async def health(raw: Request) -> Response:
    models, problems = {}, []
    for model_id, backend in served(raw).backends.items():
        models[model_id], problem = await _model_state(model_id, backend)
        if problem:
            problems.append(problem)
    if problems:
        error = Unavailable("; ".join(problems))
        return JSONResponse({**error.body(), "models": models}, status_code=error.status, headers=error.headers())
    return JSONResponse({"status": "ok", "models": models})


@router.get("/metrics", response_class=PlainTextResponse, responses=ERRORS)  # Prometheus' text format
async def metrics(raw: Request) -> Response:
    state = served(raw)
    families = [f for backend in state.backends.values() for f in await backend.metric_families()]
    return Response(render([*families, state.responses.families()]), media_type=CONTENT_TYPE_LATEST)


async def _model_state(model_id: str, backend: ModelBackend) -> tuple[dict[str, Any], Optional[str]]:
    """A model's entry in /health, and why it is not ready (None when it is)."""
    state = await backend.state()
    if state.state != "ready":
        return {"state": state.state, "error": state.reason}, state.problem(model_id)
    statuses = await backend.statuses()
    problem = _readiness_problem(statuses)
    if problem:
        return {"state": "starting", "error": problem}, f"model {model_id!r} is not ready: {problem}"
    return {"state": "ready", **model_health(statuses)}, None


def model_health(statuses: list[Any]) -> dict[str, int]:
    """/health's entry for a ready model: its live replicas and, while they still compile step
    programs in the background, the fewest any has compiled and how many there are."""
    alive = [s for s in statuses if isinstance(s, dict) and s["alive"]]
    health = {"replicas": len(alive)}
    total = max(s.get("step_programs", 0) for s in alive)  # .get: a replica of an older version (rolling update)
    if total:
        health.update(compiled_programs=min(s.get("compiled_programs", 0) for s in alive), step_programs=total)
    return health


def _readiness_problem(statuses: list[Any]) -> Optional[str]:
    """None when at least one replica is alive, else why not."""
    if any(isinstance(s, dict) and s["alive"] for s in statuses):
        return None
    if not statuses:
        return "no model server replica is running yet (loading and warming up)"
    return "; ".join(str(s["error"]) if isinstance(s, dict) else repr(s) for s in statuses)
