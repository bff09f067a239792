"""Helpers shared by the serving tests: waiting on a condition, reading server-sent events, and
finding the Ray processes a test started."""

from __future__ import annotations

import json
import re
import time
from typing import Any, Callable, Iterable


def wait_for(condition: Callable[[], Any], timeout_s: float = 30.0, what: str = "condition") -> Any:
    """Poll `condition` until it returns something truthy; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def sse_events(lines: Iterable[str]) -> list[Any]:
    """The `data:` payloads of an event stream: parsed JSON, or the string "[DONE]"."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def ray_processes(title: str) -> list:
    """The processes of this test's Ray instance (children of this process) whose title, as Ray
    sets it (`ray::<Class>` or `ray::ServeReplica:<app>:<deployment>`, then the method it runs),
    matches the regex `title` at its start."""
    import psutil

    def matches(process) -> bool:
        try:
            return re.match(title, " ".join(process.cmdline())) is not None
        except psutil.Error:  # gone (or a zombie) since it was listed
            return False

    return [p for p in psutil.Process().children(recursive=True) if matches(p)]


def engine_worker_processes() -> list:
    """The EngineWorker processes (how operators find them too)."""
    return ray_processes(r"ray::EngineWorker")


def model_server_processes(model_id: str) -> list:
    """The processes of the Ray Serve replicas of `model_id`'s server (app "llm")."""
    return ray_processes(rf"ray::ServeReplica:llm:ModelServer-{re.escape(model_id)}(\.|\s|$)")
