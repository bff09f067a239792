"""The errors every engine raises to its callers: a request it cannot serve as asked, and an engine
that can no longer serve. Pure Python; the serving layer maps them onto OpenAI error bodies."""

from __future__ import annotations

from typing import Optional


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as asked. The message says what to change; `param` names
    the offending field so the serving layer can report it in an OpenAI error body."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine's step loop has failed; no request can be served until the replica restarts."""
