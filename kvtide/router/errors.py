"""The router's own errors, in OpenAI's error object, so clients parse them like a backend's:

    {"error": {"message": "...", "type": "service_unavailable", "param": null, "code": "no_backend"}}

Kept apart from kvtide.server.errors, which pulls in the engine (and torch).
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

RETRY_AFTER_S = 1
"""Retry-After (seconds) on the router's own 503s."""

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 502: "bad_gateway", 503: "service_unavailable", 504: "timeout_error"}


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "internal_error"), "param": param,
                      "code": code}}


def error_response(message: str, status: int, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    if status == 503:
        headers = {"Retry-After": str(RETRY_AFTER_S), **(headers or {})}
    return JSONResponse(error_body(message, status, param, code), status_code=status, headers=headers)
