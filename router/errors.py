"""The router's errors, as the OpenAI error bodies and statuses a client gets."""

from __future__ import annotations

import logging
import uuid

from fastapi.responses import JSONResponse
from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError

from duet.errors import InvalidRequestError, KVTransferFailedError, PoolUnavailableError, RequestFailedError
from duet.router.responses import error_body

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An error the client gets as an OpenAI error body with ``status``."""

    def __init__(self, status: int, message: str, error_type: str, param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.param, self.retry_after = status, message, error_type, param, retry_after

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(error_body(self.message, self.error_type, self.param, self.status), self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


def api_error_from(error: Exception) -> ApiError:
    """The error response an exception from serving a request gets."""
    if isinstance(error, ApiError):
        return error
    # An error raised in a replica arrives wrapped (an instance of both RayTaskError and the
    # original class); its ``cause`` carries the message without the remote traceback.
    cause = getattr(error, "cause", None) or error
    message = str(cause)
    if isinstance(error, InvalidRequestError):
        return bad_request(message, getattr(cause, "param", None))
    if isinstance(error, (PoolUnavailableError, KVTransferFailedError)):
        return ApiError(503, message, "service_unavailable", retry_after=1)
    if isinstance(error, RequestFailedError):
        return ApiError(500, message, "internal_server_error")
    if isinstance(error, RayActorError):
        return ApiError(503, "a replica serving this request went away; retry it", "service_unavailable", retry_after=1)
    if isinstance(error, DeploymentUnavailableError):
        return ApiError(503, f"a pool cannot serve now ({message}); retry later", "service_unavailable", retry_after=5)
    incident = uuid.uuid4().hex[:12]
    logger.error("request failed (incident %s)", incident, exc_info=error)
    return ApiError(500, f"internal error (incident {incident} in the router's log)", "internal_server_error")
