"""The Ray Serve application: one model-server deployment per model, behind one ingress.

`serve run serve_app:build_app model=/path/to/checkpoint` serves a local checkpoint;
`serve run deploy/config.yaml` serves the default model. Builder args are `AppConfig` fields
(see serve_app.config), given flat for one model.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from serve_app.config import AppConfig, ModelConfig, TracingConfig
from serve_app.http.backends import ServedModel
from serve_app.http.ingress import Ingress
from serve_app.tasks import TASKS

PREFIX_ROUTER = "serve_app.http.routing:PrefixAffinityRouter"


def build_app(args: dict[str, Any]) -> Application:
    """Serve's application builder (import path `serve_app:build_app`)."""
    config = AppConfig.from_args(args)
    models = {m.model_id: served_model(m, config.tracing) for m in config.models}
    ingress = serve.deployment(Ingress).options(
        name="Ingress",
        num_replicas=config.ingress_replicas,
        ray_actor_options={"num_cpus": config.ingress_num_cpus},
        max_ongoing_requests=config.ingress_max_ongoing_requests,
    )
    return ingress.bind(config.api_key, models, config.limits, config.cors, config.tracing)


def served_model(model: ModelConfig, tracing: TracingConfig) -> ServedModel:
    """One model for the ingress: its model-server deployment, bound to its config (and the app's
    tracing where its task traces), and what the ingress needs to know of it."""
    args = (model, tracing) if TASKS[model.task].tracing else (model,)
    return ServedModel(server_deployment(model).bind(*args), model.task, model.source.describe(),
                       model.stream_silence_timeout_s, model.lora_modules)


def server_deployment(model: ModelConfig) -> serve.Deployment:
    """The model-server deployment of one model, placed and bounded as its config says. A replica
    over several hosts (`num_hosts` > 1) is a placement group: the leader's bundle, then one per
    host for its EngineWorker, which takes that host's `resources` (its chips)."""
    num_hosts = model.engine.get("num_hosts", 1)
    actor_options: dict[str, Any] = {"num_cpus": model.num_cpus}
    if model.resources and num_hosts == 1:
        actor_options["resources"] = model.resources
    if model.accelerator_type:
        actor_options["accelerator_type"] = model.accelerator_type
    if model.env_vars:
        actor_options["runtime_env"] = {"env_vars": model.env_vars}
    options: dict[str, Any] = dict(
        name=model.deployment_name,
        ray_actor_options=actor_options,
        max_ongoing_requests=model.max_ongoing_requests,
        max_queued_requests=model.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=model.retry_after_s),
        health_check_period_s=model.health_check_period_s,
        health_check_timeout_s=model.health_check_timeout_s,
        graceful_shutdown_timeout_s=model.graceful_shutdown_timeout_s,
    )
    if model.max_constructor_retry_count is not None:
        options["max_constructor_retry_count"] = model.max_constructor_retry_count
    if model.request_router == "prefix_affinity" and TASKS[model.task].prefix_routing:
        options["request_router_config"] = RequestRouterConfig(request_router_class=PREFIX_ROUTER)
    if model.autoscaling_config:
        options["autoscaling_config"] = model.autoscaling_config
    else:
        options["num_replicas"] = model.num_replicas
    bundles = model.placement_group_bundles
    if bundles is None and num_hosts > 1 and not model.engine.get("tpu_topology"):  # else the leader reserves a slice
        bundles = [{"CPU": model.num_cpus}] + [{"CPU": model.num_cpus, **model.resources}] * num_hosts
    if bundles:
        options["placement_group_bundles"] = bundles
        options["placement_group_strategy"] = model.placement_group_strategy
    return serve.deployment(TASKS[model.task].replica_class()).options(**options)
