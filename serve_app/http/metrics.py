"""The ingress's /metrics: every model-server replica's families (asked with `handle.broadcast`)
rendered together with `render`, and the ingress's own `HttpResponses` (every HTTP answer by route
and status, labelled with its ingress replica)."""

from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric


class HttpResponses:
    """`jax_serve:http_responses`: the ingress's HTTP answers by route (the matched route's path,
    or "unmatched") and status code, so that error rates are one query. One per ingress replica,
    labelled with it; `CountResponses` records into it."""

    def __init__(self, replica: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self._counter = Counter("jax_serve:http_responses", "HTTP responses of the ingress, by route and status.",
                                ["route", "status", "ingress"], registry=self.registry)
        self._replica = replica

    def count(self, route: str, status: int) -> None:
        self._counter.labels(route, str(status), self._replica).inc()

    def families(self) -> list[Metric]:
        return list(self.registry.collect())


class CountResponses:
    """ASGI middleware counting every HTTP response into `responses` (outermost, so that it sees
    the answers of the other middleware too)."""

    def __init__(self, app, responses: HttpResponses):
        self.app, self.responses = app, responses

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # an app that raises before it answers gets Starlette's 500

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            self.responses.count(getattr(scope.get("route"), "path", "unmatched"), status)


class _Families:
    """A collector over fixed families, for `generate_latest`."""

    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def render(per_replica: Iterable[list[Metric]]) -> bytes:
    """Prometheus text exposition of several replicas' families, merged by metric name."""
    merged: dict[str, Metric] = {}
    for families in per_replica:
        for family in families:
            target = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            target.samples.extend(family.samples)
    return generate_latest(_Families(list(merged.values())))

