"""The gate every HTTP request and WebSocket passes (a plain ASGI middleware: it never buffers
responses, so streaming and disconnect detection are untouched).

    /health ─────────────────────────────────────────────────────────────▶ app (answers 200/503)
    other   ─▶ 400 Host ─▶ 503 draining/dead ─▶ 431 header size ─▶ 401 key ─▶ 415 content type
            ─▶ 413 body size ─▶ count in flight ─▶ app
    (a POST, PUT, PATCH or DELETE: 403 Origin after the Host check, as a WebSocket's)
    WebSocket ─▶ 400 Host, 403 Origin (instead of the handshake) ─▶ 503/431/401 as above ─▶ app

The Host, Origin and content-type checks keep web pages from driving a server that has no key
(server/browser_policy.py says why and what passes). A POST, PUT or PATCH with a body must say
`Content-Type: application/json` (parameters allowed): a browser sends text/plain, forms and bare
Blobs cross-origin without asking, JSON it does not; one without a body may omit the type.

`GET /` (the chat page, unless --no-ui) skips only the key check: the page holds no secret, and
asks for the key before it calls the API.

The key check: with --api-key alone, that key. With --api-keys-file, the per-key QuotaMiddleware
(server/quotas.py, installed inside this one) checks the key of every route it limits (the
--api-key key passes there as an unlimited entry); this gate then checks only the routes the
quotas skip (QUOTA_EXEMPT_PATHS: /metrics, and the chat page's path), accepting either key.

A WebSocket whose Host or Origin is refused gets an HTTP answer (400, 403) instead of the
handshake: a page that may not drive the server learns nothing more. Any other refused WebSocket
(`websocket` scope) is accepted, sent the error's OpenAI JSON as one text message and closed: code
1013 (try again later) while draining or dead, 1008 (policy) for a missing or wrong key or
oversized headers. Accepted, it counts as in flight until it closes.

File uploads (POST /v1/files, UPLOAD_PATHS) are the one exception to JSON: multipart/form-data,
up to --max-batch-file-bytes (plus the form's own bytes; past it a 400) rather than
--max-request-body; the Origin check above is what keeps pages from posting them cross-origin.

The body is read here, up to --max-request-body bytes (Content-Length is checked first, then the
bytes actually received), and replayed to the app; after it, `receive` is the server's again, so
the app still sees http.disconnect.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable

from kvtide.server.asgi import (
    ADMIN_SCOPE_KEY,
    WS_CLOSE_POLICY,
    WS_CLOSE_TRY_AGAIN_LATER,
    Message,
    Receive,
    Scope,
    Send,
    api_key_from_headers,
    invalid_api_key,
    reject_websocket,
    send_error,
)
from kvtide.server.browser_policy import BrowserPolicy, is_json_content_type
from kvtide.server.errors import RETRY_AFTER_S, OpenAIError
from kvtide.server.limits import MAX_HEADER_BYTES
from kvtide.server.state import ServerState

logger = logging.getLogger("kvtide.server")

UNGUARDED_PATHS = ("/health",)
"""Open without an API key and answering for themselves while draining or dead."""
UI_PAGE = ("GET", "/")
"""(method, path) of the chat page: served without the API key while the UI is enabled."""
UNCOUNTED_PATHS = ("/health", "/metrics")
"""Not counted as requests in flight (a drain does not wait for scrapes)."""
QUOTA_EXEMPT_PATHS = ("/health", "/metrics", "/")
"""Paths the per-key quotas (--api-keys-file) neither limit nor authenticate: this gate does."""
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
"""Methods a page's request may use from any Origin (they change nothing, and without CORS headers
the page cannot read the answer)."""
UPLOAD_PATHS = ("/v1/files",)
"""POST paths that take a multipart/form-data upload (checked by the route) within the batch file limit."""
MAX_LOGGED_REFUSALS = 64
"""Distinct refused Hosts and Origins logged (each once): a hostile page cannot flood the log."""


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


class ServerGuardMiddleware:
    def __init__(self, app: Callable, state: ServerState) -> None:
        self.app = app
        self.state = state
        self.browser = BrowserPolicy(state.settings.allowed_origins, state.settings.allowed_hosts)
        self._logged_refusals: set[str] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http" or scope["path"] in UNGUARDED_PATHS:
            await self.app(scope, receive, send)
            return
        error = self._check_host(scope)
        if error is None and scope["method"] not in SAFE_METHODS:
            # A page may send an empty or JSON-less POST cross-origin without asking first; a browser
            # always says which page sent it.
            error = self._check_origin(scope)
        error = error or self._check_headers(scope)
        upload = _is_upload(scope)
        if error is None and scope["method"] in ("POST", "PUT", "PATCH") and not upload:
            error = _check_content_type(scope)
        if error is not None:
            await send_error(send, error)
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            try:
                body = await _read_body(receive, self._body_limit(scope))
            except _BodyTooLarge:
                await send_error(send, self._too_large(scope))
                return
            except _ClientGone:
                return
            if body and _header(scope, b"content-type") is None:
                await send_error(send, _not_json(None))
                return
            receive = _replay(body, receive)
            if not upload:
                scope = _as_json(scope)
        counted = scope["path"] not in UNCOUNTED_PATHS
        if counted:
            self.state.num_inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            if counted:
                self.state.num_inflight -= 1

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The same gate for a WebSocket, before it is accepted (the body limit applies to its
        message: see openai/websocket.py)."""
        error = self._check_host(scope) or self._check_origin(scope)
        if error is not None:
            await refuse_websocket_handshake(scope, receive, send, error)
            return
        error = self._check_headers(scope)
        if error is not None:
            code = WS_CLOSE_TRY_AGAIN_LATER if error.status == 503 else WS_CLOSE_POLICY
            await reject_websocket(receive, send, error, code)
            return
        self.state.num_inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_inflight -= 1

    def _check_host(self, scope: Scope) -> OpenAIError | None:
        host = _header(scope, b"host")
        if self.browser.host_allowed(host):
            return None
        self._log_refusal("Host", host)
        return OpenAIError(f"Host {host!r} is not allowed: this server answers only to --allowed-hosts "
                           "(bound to a loopback address: localhost, 127.0.0.1, [::1])", 400, param="Host",
                           code="invalid_host")

    def _check_origin(self, scope: Scope) -> OpenAIError | None:
        origin = _header(scope, b"origin")
        if self.browser.origin_allowed(origin, _header(scope, b"host"), scope.get("scheme", "ws")):
            return None
        self._log_refusal("Origin", origin)
        return OpenAIError(f"Origin {origin!r} may not drive this server: only same-origin and loopback "
                           "pages and --allowed-origins may", 403, param="Origin", code="origin_not_allowed",
                           error_type="permission_error")

    def _log_refusal(self, what: str, value: str | None) -> None:
        key = f"{what}: {value}"
        if key not in self._logged_refusals and len(self._logged_refusals) < MAX_LOGGED_REFUSALS:
            self._logged_refusals.add(key)
            logger.warning("refused a request with %s %r (see --allowed-%ss; logged once)", what, value,
                           what.lower())

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
        if self._needs_key(scope) and not self._key_accepted(headers):
            return invalid_api_key()
        length = headers.get("content-length")
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                return OpenAIError("Content-Length is not an integer", 400, code="invalid_body")
            if size > self._body_limit(scope):
                return self._too_large(scope)
        return None

    def _body_limit(self, scope: Scope) -> int:
        if _is_upload(scope):
            return self.state.settings.batch.max_upload_body
        return self.state.settings.max_request_body

    def _too_large(self, scope: Scope) -> OpenAIError:
        if _is_upload(scope):
            # 400, as the store answers a file over the limit that fits in the slack.
            return OpenAIError(f"file: over this server's limit of {self.state.settings.batch.max_file_bytes} "
                               f"bytes (--max-batch-file-bytes)", 400, param="file", code="file_too_large")
        return _too_large(self.state.settings.max_request_body)

    def _is_ui_page(self, scope: Scope) -> bool:
        return (self.state.settings.enable_ui and scope["type"] == "http"
                and (scope["method"], scope["path"]) == UI_PAGE)

    def _needs_key(self, scope: Scope) -> bool:
        settings = self.state.settings
        if scope.get(ADMIN_SCOPE_KEY):
            return False  # AdminGate checked the admin key
        if settings.api_key is None and settings.api_keys is None:
            return False
        if self._is_ui_page(scope):
            return False
        # With --api-keys-file, QuotaMiddleware checks the key of every path it limits.
        return settings.api_keys is None or scope["path"] in QUOTA_EXEMPT_PATHS

    def _key_accepted(self, headers: dict[str, bytes]) -> bool:
        settings = self.state.settings
        if settings.api_key is not None and _authorized(headers, settings.api_key):
            return True
        return settings.api_keys is not None and settings.api_keys.lookup(api_key_from_headers(headers)) is not None


def _authorized(headers: dict[str, bytes], api_key: str) -> bool:
    # Constant time in the key's content: a timing side channel must not reveal a prefix.
    return hmac.compare_digest(api_key_from_headers(headers), api_key.encode())


def _is_upload(scope: Scope) -> bool:
    return scope["method"] == "POST" and scope["path"] in UPLOAD_PATHS


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


def _header(scope: Scope, name: bytes) -> str | None:
    """The first value of header `name` (lower case), or None."""
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _check_content_type(scope: Scope) -> OpenAIError | None:
    """A declared type must be JSON (a missing one is checked once the body is read: allowed only
    for an empty body)."""
    content_type = _header(scope, b"content-type")
    if content_type is None or is_json_content_type(content_type):
        return None
    return _not_json(content_type)


def _not_json(content_type: str | None) -> OpenAIError:
    return OpenAIError(f"Content-Type {content_type!r} is not supported: send the body as JSON with "
                       "'Content-Type: application/json'", 415, param="Content-Type",
                       code="unsupported_media_type")


def _as_json(scope: Scope) -> Scope:
    """Every body that passed here is JSON (or empty): say so to the app whatever parameters the
    client added."""
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


async def refuse_websocket_handshake(scope: Scope, receive: Receive, send: Send, error: OpenAIError) -> None:
    """Refuse a WebSocket with an HTTP answer instead of the handshake (a page's script learns only
    that it failed): `error`'s status and JSON where the server has the ASGI websocket.http.response
    extension (uvicorn does), else a bare 403."""
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    if "websocket.http.response" not in (scope.get("extensions") or {}):
        await send({"type": "websocket.close", "code": WS_CLOSE_POLICY})
        return
    payload = json.dumps(error.body()).encode()
    await send({"type": "websocket.http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "websocket.http.response.body", "body": payload})
