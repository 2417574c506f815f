"""The router's ASGI app: the OpenAI generation routes relayed to backends, GET /v1/models from a
healthy backend, GET /health for the router itself, GET /metrics for its own metrics.

    request ─▶ [quotas (--api-keys-file)] ─▶ [API key (--api-key)] ─▶ route
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp

from kvtide.router.config import MAX_REQUEST_BODY, RouterSettings
from kvtide.router.disagg import prefill_then_decode
from kvtide.router.errors import error_response
from kvtide.router.health import check_all, health_loop
from kvtide.router.prompt_text import prompt_text
from kvtide.router.proxy import (
    Failure,
    backend_headers,
    client_headers,
    open_upstream,
    relay,
    until_disconnected,
)
from kvtide.router.state import RouterState

logger = logging.getLogger("kvtide.router")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def build_app(settings: RouterSettings) -> ASGIApp:
    """The app, with its middlewares. Raises ValueError on bad settings or a bad --api-keys-file,
    before anything listens."""
    settings.check()
    api_keys = None
    if settings.api_keys_file:
        # Imported here: the quota module is optional for everything else the router does.
        from kvtide.server.quotas import QuotaMiddleware, load_api_keys

        api_keys = load_api_keys(settings.api_keys_file)  # a bad file fails before any client opens
    state = RouterState(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await check_all(state)  # so the first requests already know who is up
        loop_task = asyncio.create_task(health_loop(state))
        try:
            yield
        finally:
            loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop_task
            await state.aclose()

    app = FastAPI(title="kvtide router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = state

    for path in GENERATION_PATHS:
        app.add_api_route(path, _generation_handler(state, path), methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await _models(state, request)

    @app.get("/health")
    async def health() -> Response:
        healthy = sum(b.healthy for b in state.backends.values())
        if not state.serving_pool_healthy():
            return error_response("no healthy backend", 503, code="no_healthy_backend")
        return JSONResponse({"status": "ok", "healthy_backends": healthy, "backends": len(state.backends)})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    wrapped: ASGIApp = app
    if settings.api_key:
        from kvtide.router.auth import ApiKeyMiddleware

        wrapped = ApiKeyMiddleware(wrapped, settings.api_key)
    if api_keys is not None:
        wrapped = QuotaMiddleware(wrapped, api_keys, registry=state.metrics.registry)
    return wrapped


def _generation_handler(state: RouterState, path: str):
    async def handler(request: Request) -> Response:
        request_id = request.headers.get("x-request-id") or f"rtr-{uuid.uuid4()}"
        response = await _read_and_route(state, request, path, request_id)
        if response is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        response.headers["x-request-id"] = request_id
        return response

    handler.__name__ = "relay_" + path.strip("/").replace("/", "_")
    return handler


async def _read_and_route(state: RouterState, request: Request, path: str, request_id: str) -> Response | None:
    body = await read_body_within(request, MAX_REQUEST_BODY)
    if body is None:
        response = error_response(f"request body over {MAX_REQUEST_BODY} bytes", 413, code="body_too_large")
        response.headers["connection"] = "close"  # the rest of the body stays unread
        return response
    payload = _json_object(body)
    text = prompt_text(payload)
    headers = backend_headers(request, request_id, state.settings.backend_api_key)
    if state.prefill_policy is not None and payload is not None:
        work = prefill_then_decode(state, path, payload, headers, text, request_id)
    else:
        # Not JSON: any backend answers the 400 as it would.
        work = _route(state, path, body, headers, text, bool(payload and payload.get("stream")), request_id)
    return await until_disconnected(request, work)


async def _route(state: RouterState, path: str, body: bytes, headers: dict[str, str], text: str, stream: bool,
                 request_id: str) -> Response:
    outcome = await open_upstream(state, state.policy, path, body, headers, text, stream=stream,
                                  timeout=state.settings.request_timeout)
    if isinstance(outcome, Failure):
        return outcome.response
    return await relay(state, outcome, request_id)


async def read_body_within(request: Request, limit: int) -> bytes | None:
    """The request's body, or None as soon as it is known to exceed `limit` bytes: a declared
    Content-Length before anything is read, else the bytes as they arrive (a chunked body), so a
    huge body costs at most `limit` bytes of memory, never its own size."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


async def _models(state: RouterState, request: Request) -> Response:
    """GET /v1/models from the first healthy backend that answers (decode pool first)."""
    request_id = request.headers.get("x-request-id") or f"rtr-{uuid.uuid4()}"
    headers = backend_headers(request, request_id, state.settings.backend_api_key)
    for backend in sorted(state.backends.values(), key=lambda b: b not in state.policy.pool.backends):
        if not backend.healthy:
            continue
        try:
            response = await state.http.get(backend.url + "/v1/models", headers=headers, timeout=30.0)
        except httpx.TimeoutException:
            continue
        except httpx.TransportError as e:
            state.eject(backend, f"connection error: {type(e).__name__}")
            continue
        return Response(response.content, status_code=response.status_code,
                        headers=client_headers(response, request_id))
    return error_response("no healthy backend", 503, code="no_healthy_backend")
