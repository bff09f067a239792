"""/v1/models and /v1/models/{model_id}: the served models, with their task and state, and the
LoRA adapters with their `parent`."""

from __future__ import annotations

from fastapi import APIRouter, Request

from serve_app.http.adapter_routes import AdapterRoute
from serve_app.http.backends import ModelBackend
from serve_app.http.served import served
from serve_app.protocol.admin import ModelCard, ModelList

router = APIRouter(prefix="/v1")


@router.get("/models")
async def models(raw: Request) -> ModelList:
    backends, adapters = served(raw).backends, served(raw).adapters
    cards = [await _card(model_id, b) for model_id, b in backends.items()]
    return ModelList(data=cards + [await _adapter_card(r, backends[r.base]) for r in adapters.routes()])


@router.get("/models/{model_id:path}")
async def model(model_id: str, raw: Request) -> ModelCard:
    models = served(raw)
    route = models.adapters.get(model_id)
    if route is not None:
        return await _adapter_card(route, models.backends[route.base])
    if model_id not in models.backends:
        raise models.unknown_model(model_id)
    return await _card(model_id, models.backends[model_id])


async def _card(model_id: str, backend: ModelBackend) -> ModelCard:
    state = await backend.state()
    return ModelCard(id=model_id, root=backend.root, task=backend.task, state=state.state, error=state.reason)


async def _adapter_card(route: AdapterRoute, backend: ModelBackend) -> ModelCard:
    """An adapter's card: its base model's task and state."""
    state = await backend.state()
    return ModelCard(id=route.ref.name, root=route.ref.path, parent=route.base, task=backend.task, state=state.state,
                     error=state.reason)
