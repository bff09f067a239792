"""/v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): LoRA adapters added and removed at
run time, held by the ingress replica that received them (serve_app.http.adapter_routes)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel

from serve_app.http.dispatch import answered
from serve_app.http.schema import json_body
from serve_app.http.served import Served, served
from serve_app.protocol.admin import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from serve_app.protocol.base import parse_request
from serve_app.protocol.context import LoraRef

router = APIRouter(prefix="/v1")


@router.post("/load_lora_adapter", openapi_extra=json_body(LoadLoraAdapterRequest), response_class=PlainTextResponse)
async def load_lora_adapter(raw: Request) -> Response:
    return await answered(_change(raw, LoadLoraAdapterRequest, _load))


@router.post("/unload_lora_adapter", openapi_extra=json_body(UnloadLoraAdapterRequest),
             response_class=PlainTextResponse)
async def unload_lora_adapter(raw: Request) -> Response:
    return await answered(_change(raw, UnloadLoraAdapterRequest, _unload))


Change = Callable[[Served, Any], Awaitable[str]]
"""Changes the adapters' routes as a request asks; returns the answer's text."""


async def _change(raw: Request, request_cls: type[BaseModel], change: Change) -> Response:
    return PlainTextResponse(await change(served(raw), parse_request(request_cls, await raw.body())))


async def _load(models: Served, request: LoadLoraAdapterRequest) -> str:
    """Read the adapter on one replica of its base model (refusing what the engine cannot
    serve), then route its name; the other replicas read it on first use."""
    base = models.lora_base(request.base_model_name)
    models.adapters.check(request.lora_name, replace=request.load_inplace)
    ref = LoraRef(request.lora_name, request.lora_path)
    await models.backends[base].call("load_adapter", ref, lora=ref)
    models.adapters.add(base, request.lora_name, request.lora_path, replace=True)
    return f"Success: LoRA adapter '{request.lora_name}' added successfully."


async def _unload(models: Served, request: UnloadLoraAdapterRequest) -> str:
    models.adapters.remove(request.lora_name)
    return f"Success: LoRA adapter '{request.lora_name}' removed successfully."
