"""Exceptions of the serving layer and their OpenAI error bodies.

Every failure a client sees has the body `{"error": {"message", "type", "param", "code"}}` and an
HTTP status. `to_api_error` maps anything raised while serving a request (ours, the engine's, Ray
Serve's, or an exception wrapped by a Ray handle hop) onto one `APIError`.

Invariant: an `APIError` pickles as `(message, param)` or `(message, retry_after_s)`, so it crosses
the Ray hop from a model server to the ingress intact.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from engine.errors import EngineDeadError, InvalidRequestError

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error the client should see as it is."""

    status: int = 500
    type: str = "server_error"
    code: Optional[str] = None

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message, param)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {}


class BadRequest(APIError):
    """400: a value the server cannot serve, or a feature it does not support yet."""

    status = 400
    type = "invalid_request_error"


class Unauthorized(APIError):
    """401: the API key is missing or wrong."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFound(APIError):
    """404: an unknown model (or route)."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class RouteNotFound(NotFound):
    code = "unknown_url"


class MethodNotAllowed(APIError):
    """405: a known route with the wrong HTTP method."""

    status = 405
    type = "invalid_request_error"


class PayloadTooLarge(APIError):
    """413: the request body is over the server's size limit."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class Overloaded(APIError):
    """429: the bounded request queue is full; retry after `retry_after_s`."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.args = (message, retry_after_s)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class Unavailable(APIError):
    """503: the model is not loaded yet, its engine died or its replica is stopping (another replica
    or a restarted one takes the retry)."""

    status = 503
    type = "server_error"
    code = "service_unavailable"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


def to_api_error(exc: BaseException) -> APIError:
    """The `APIError` a client should see for `exc`; unexpected exceptions are logged here."""
    exc = getattr(exc, "cause", None) or exc  # a RayTaskError carries the replica's exception
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return BadRequest(str(exc), exc.param)
    if isinstance(exc, EngineDeadError):
        return Unavailable(f"{exc}; the model server is restarting, retry shortly")
    if isinstance(exc, RayActorError):  # the replica went (shut down past its grace time, scaled down, lost)
        return Unavailable("the model server stopped while serving this request (it was shut down, scaled down "
                           "or lost); retry")
    if isinstance(exc, DeploymentUnavailableError):  # Serve gave up starting its replicas (a race with ModelStates)
        return Unavailable("the model's replicas are not running (they failed to start); see /health for why")
    if isinstance(exc, BackPressureError):
        retry_after_s = exc.retry_after_s if exc.retry_after_s is not None else 1.0
        return Overloaded(f"the server is at capacity ({exc.message}); retry later", retry_after_s)
    logger.error("internal error while serving a request", exc_info=exc)
    return APIError(f"internal server error ({type(exc).__name__}); see the server log")
