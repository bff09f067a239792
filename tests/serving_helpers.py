"""Helpers shared by the serving tests: waiting on a condition, and reading server-sent events."""

from __future__ import annotations

import json
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
