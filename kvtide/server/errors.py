"""Errors at the HTTP edge, always as OpenAI's error object:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Serving code raises `OpenAIError` (or lets a ValueError from validation through); the handlers
installed here turn it, pydantic validation errors, bad JSON and Starlette's HTTP errors into
that object with the right status. Nothing a client sends yields a 500.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtide.engine.core_client import EngineDeadError, EngineGenerateError, EngineQueueFullError

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
"""Retry-After (seconds) sent with 429 and 503."""

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error", 415: "invalid_request_error",
          422: "invalid_request_error", 431: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
          503: "service_unavailable"}

# The first word of SamplingParams / InputProcessor messages is the parameter they are about.
_PARAM_NAMES = {
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "stop",
    "stop_token_ids", "logit_bias", "prompt", "prompt_token_ids", "messages", "top_logprobs",
    "use_beam_search", "beam_width", "length_penalty", "early_stopping", "cache_salt", "structured_outputs",
}


class OpenAIError(Exception):
    """An error the server answers with; `status` picks the HTTP code."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 error_type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return OpenAIError(message, status, param, code, headers=headers).response()


def from_value_error(error: ValueError, param: str | None = None) -> OpenAIError:
    message = str(error)
    if param is None:
        first = message.split(" ", 1)[0].rstrip(":").split(".", 1)[0]
        param = first if first in _PARAM_NAMES else None
    code = "context_length_exceeded" if "max_model_len" in message else None
    return OpenAIError(message, 400, param, code)


def from_engine_error(error: BaseException) -> OpenAIError:
    """An exception from AsyncLLM.generate -> the error to answer with."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, EngineQueueFullError):
        return OpenAIError(f"server overloaded: {error}", 429, code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(error, EngineDeadError):
        return OpenAIError(f"engine is dead: {error}", 503, code="engine_dead")
    if isinstance(error, EngineGenerateError):
        if error.status is not None:  # the request was at fault (its grammar), not the engine
            return OpenAIError(str(error), error.status, "structured_outputs",
                               "grammar_compile_timeout" if error.status == 408 else "invalid_grammar")
        return OpenAIError(f"request failed in the engine: {error}", 500, code="engine_error")
    if isinstance(error, ValueError):
        return from_value_error(error)
    logger.exception("unexpected error", exc_info=error)
    return OpenAIError(f"internal error: {type(error).__name__}", 500, code="internal_error")


def validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request", 400)
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return OpenAIError(f"request body is not valid JSON: {first.get('msg', '')}", 400, code="invalid_json")
    if not loc and kind in ("model_attributes_type", "dict_type", "missing"):
        return OpenAIError("request body must be a JSON object", 400, code="invalid_body")
    param = _param_of(loc)
    message = first.get("msg", "invalid value")
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return OpenAIError(f"{param or 'body'}: {message}", 400, param or None)


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _param_of(loc: list[str]) -> str | None:
    """('stream_options', 'include_usage') -> 'stream_options.include_usage'; union branch tags
    ('prompt', 'list[str]', '0') and list positions end the path."""
    if not loc:
        return None
    parts = [loc[0]]
    for part in loc[1:]:
        if part.isdigit() or part in _UNION_TAGS or any(ch in part for ch in "[]-"):
            break
        parts.append(part)
    return ".".join(parts)


def install_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        return from_value_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        message = exc.detail if isinstance(exc.detail, str) and exc.detail != phrase else phrase
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return from_engine_error(exc).response()
