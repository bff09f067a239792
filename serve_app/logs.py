"""The Ray Serve replica a process is: its name (the `replica` / `ingress` label of metrics) and where
the serving layer's and the engine's log lines go."""

from __future__ import annotations

import logging

from ray import serve
from ray.serve.exceptions import RayServeException


def route_logs_to_replica_log() -> None:
    """Send the engine's and this package's INFO lines (warm-up time, one line per request) to the
    replica's Ray Serve log; otherwise Ray's root logger drops them."""
    serve_logger = logging.getLogger("ray.serve")
    for name in ("engine", "serve_app"):
        package_logger = logging.getLogger(name)
        package_logger.setLevel(logging.INFO)
        for handler in serve_logger.handlers:
            if handler not in package_logger.handlers:
                package_logger.addHandler(handler)
        package_logger.propagate = not serve_logger.handlers


def replica_name() -> str:
    """The Serve replica this process is (the `replica` / `ingress` label), or "local" outside one."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:  # not inside a Serve replica (tests, a single process)
        return "local"
