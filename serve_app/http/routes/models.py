"""/v1/models and /v1/models/{model_id}: the served models, with their task and state, and the
LoRA adapters with their `parent`; a ready model's facts (max_model_len, sampling defaults,
dimensions) as one of its live replicas reports them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from serve_app.http.adapter_routes import AdapterRoute
from serve_app.http.backends import ModelBackend
from serve_app.http.model_states import ModelState
from serve_app.http.served import served
from serve_app.protocol.admin import ModelCard, ModelList

router = APIRouter(prefix="/v1")
CARD_FACTS = frozenset(ModelCard.model_fields) - {"id", "object", "created", "owned_by", "root", "task", "state",
                                                  "error", "parent"}
"""The ModelCard fields a replica reports (serve_app.replicas.base.Replica.card)."""


@router.get("/models")
async def models(raw: Request) -> ModelList:
    backends, adapters = served(raw).backends, served(raw).adapters
    known = {model_id: await _known(backend) for model_id, backend in backends.items()}
    cards = [_card(model_id, b, *known[model_id]) for model_id, b in backends.items()]
    return ModelList(data=cards + [_adapter_card(r, backends[r.base], *known[r.base]) for r in adapters.routes()])


@router.get("/models/{model_id:path}")
async def model(model_id: str, raw: Request) -> ModelCard:
    models = served(raw)
    route = models.adapters.get(model_id)
    if route is not None:
        backend = models.backends[route.base]
        return _adapter_card(route, backend, *await _known(backend))
    if model_id not in models.backends:
        raise models.unknown_model(model_id)
    backend = models.backends[model_id]
    return _card(model_id, backend, *await _known(backend))


async def _known(backend: ModelBackend) -> tuple[ModelState, dict[str, Any]]:
    """A model's state, and the facts a live replica reports once it is ready."""
    state = await backend.state()
    return state, (await replica_card(backend) if state.state == "ready" else {})


def _card(model_id: str, backend: ModelBackend, state: ModelState, facts: dict[str, Any]) -> ModelCard:
    return ModelCard(id=model_id, root=backend.root, task=backend.task, state=state.state, error=state.reason,
                     **facts)


def _adapter_card(route: AdapterRoute, backend: ModelBackend, state: ModelState, facts: dict[str, Any]) -> ModelCard:
    """An adapter's card: its base model's task, state and facts."""
    return ModelCard(id=route.ref.name, root=route.ref.path, parent=route.base, task=backend.task, state=state.state,
                     error=state.reason, **facts)


async def replica_card(backend: ModelBackend) -> dict[str, Any]:
    """The card fields the first live replica reports (serve_app.replicas.base.Replica.card: its
    max_model_len, and a text model's sampling defaults or an embedding model's dimensions), those
    ModelCard has; {} when no replica answers."""
    for status in await backend.statuses():
        if isinstance(status, dict) and status.get("alive") and isinstance(status.get("card"), dict):
            return {k: v for k, v in status["card"].items() if k in CARD_FACTS}
    return {}
