"""The gate every HTTP request passes (a plain ASGI middleware: it never buffers responses, so
streaming and disconnect detection are untouched).

    /health ─────────────────────────────────────────────────────────────▶ app (answers 200/503)
    other   ─▶ 503 draining/dead ─▶ 431 header size ─▶ 401 key ─▶ 413 body size ─▶ count in flight ─▶ app

`GET /` (the chat page, unless --no-ui) skips only the key check: the page holds no secret, and
asks for the key before it calls the API.

The body is read here, up to --max-request-body bytes (Content-Length is checked first, then the
bytes actually received), and replayed to the app; after it, `receive` is the server's again, so
the app still sees http.disconnect.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from kvtide.server.errors import RETRY_AFTER_S, OpenAIError
from kvtide.server.limits import MAX_HEADER_BYTES
from kvtide.server.state import ServerState

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

UNGUARDED_PATHS = ("/health",)
"""Open without an API key and answering for themselves while draining or dead."""
UI_PAGE = ("GET", "/")
"""(method, path) of the chat page: served without the API key while the UI is enabled."""
UNCOUNTED_PATHS = ("/health", "/metrics")
"""Not counted as requests in flight (a drain does not wait for scrapes)."""


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


class ServerGuardMiddleware:
    def __init__(self, app: Callable, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNGUARDED_PATHS:
            await self.app(scope, receive, send)
            return
        error = self._check_headers(scope)
        if error is not None:
            await _send_error(send, error)
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            try:
                body = await _read_body(receive, self.state.settings.max_request_body)
            except _BodyTooLarge:
                await _send_error(send, _too_large(self.state.settings.max_request_body))
                return
            except _ClientGone:
                return
            receive = _replay(body, receive)
            scope = _as_json(scope)
        counted = scope["path"] not in UNCOUNTED_PATHS
        if counted:
            self.state.num_inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            if counted:
                self.state.num_inflight -= 1

    def _check_headers(self, scope: Scope) -> OpenAIError | None:
        reason = self.state.unavailable_reason
        if reason is not None:
            return OpenAIError(f"Service unavailable: {reason}", 503, code="unavailable",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        raw_headers = scope.get("headers", [])
        header_bytes = sum(len(k) + len(v) for k, v in raw_headers)
        if header_bytes > MAX_HEADER_BYTES:
            return OpenAIError(f"Request headers total {header_bytes} bytes, over the limit of "
                               f"{MAX_HEADER_BYTES}", 431, code="headers_too_large")
        headers = {k.decode("latin-1").lower(): v for k, v in raw_headers}
        api_key = self.state.settings.api_key
        if api_key is not None and not self._is_ui_page(scope) and not _authorized(headers, api_key):
            return OpenAIError("Invalid or missing API key: pass it as 'Authorization: Bearer KEY'", 401,
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length")
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                return OpenAIError("Content-Length is not an integer", 400, code="invalid_body")
            if size > self.state.settings.max_request_body:
                return _too_large(self.state.settings.max_request_body)
        return None

    def _is_ui_page(self, scope: Scope) -> bool:
        return self.state.settings.enable_ui and (scope["method"], scope["path"]) == UI_PAGE


def _authorized(headers: dict[str, bytes], api_key: str) -> bool:
    value = headers.get("authorization", b"")
    scheme, _, token = value.partition(b" ")
    if scheme.lower() != b"bearer":
        token = headers.get("x-api-key", b"")
    # Constant time in the key's content: a timing side channel must not reveal a prefix.
    return hmac.compare_digest(token.strip(), api_key.encode())


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(f"Request body exceeds the limit of {limit} bytes (--max-request-body)", 413,
                       code="request_too_large")


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _as_json(scope: Scope) -> Scope:
    """Every POST body here is JSON: parse it as such even when the client did not say so
    (curl -d sends application/x-www-form-urlencoded)."""
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"]
    headers.append((b"content-type", b"application/json"))
    return {**scope, "headers": headers}


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(send: Send, error: OpenAIError) -> None:
    payload = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    for key, value in (error.headers or {}).items():
        headers.append((key.lower().encode("latin-1"), value.encode("latin-1")))
    # The body may be unread (413 on Content-Length): close the connection rather than drain it.
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
