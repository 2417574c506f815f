"""Errors in Anthropic's shape, for /v1/messages:

    {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}

The server's own errors (OpenAIError, request validation) keep their status and message; only
the body changes. Refusals the gate answers before the route (401, 413, 503) stay OpenAI's.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from kvtide.server.errors import OpenAIError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 422: "invalid_request_error",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(error: OpenAIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(error.status, "api_error"), "message": error.message}}


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)
