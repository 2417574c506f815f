"""What every ASGI gate of the server shares (ServerGuardMiddleware, QuotaMiddleware, AdminGate,
the WebSocket routes): the ASGI types, the key a request presents, and how a refusal is answered
over HTTP and over a WebSocket. Below the gates, so none of them imports another for these.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from kvtide.server.errors import OpenAIError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

ADMIN_SCOPE_KEY = "kvtide.admin"
"""Set by AdminGate (server/admin.py) in the scope of a request that presented the admin key on an
admin path: neither the server's gate nor the quotas ask it for a client key."""

WS_CLOSE_POLICY = 1008
"""WebSocket close code for a refused key, oversized headers or an invalid request."""
WS_CLOSE_TRY_AGAIN_LATER = 1013
"""WebSocket close code while the server drains or its engine is dead, and over a quota."""


def api_key_from_headers(headers: dict[str, bytes]) -> bytes:
    """The key a request presents: `Authorization: Bearer KEY`, else `x-api-key: KEY` (b"" if none).
    `headers` has lower-case names."""
    value = headers.get("authorization", b"")
    scheme, _, token = value.partition(b" ")
    if scheme.lower() != b"bearer":
        token = headers.get("x-api-key", b"")
    return token.strip()


def invalid_api_key() -> OpenAIError:
    return OpenAIError("Invalid or missing API key: pass it as 'Authorization: Bearer KEY'", 401,
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def send_error(send: Send, error: OpenAIError) -> None:
    """Answer an HTTP request with `error` as OpenAI's error JSON (and its headers)."""
    payload = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    for key, value in (error.headers or {}).items():
        headers.append((key.lower().encode("latin-1"), value.encode("latin-1")))
    # The body may be unread (413 on Content-Length): close the connection rather than drain it.
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


async def reject_websocket(receive: Receive, send: Send, error: OpenAIError, close_code: int) -> None:
    """Refuse a WebSocket before the app sees it: accept (a refused handshake would carry neither
    a close code nor a message), send the error's OpenAI JSON as one text message, close with
    `close_code`. Retry-After, if the error has one, is in the message (no headers here)."""
    message = await receive()
    if message["type"] != "websocket.connect":
        return  # the client left before the handshake ended
    await send({"type": "websocket.accept"})
    body = error.body()
    retry_after = (error.headers or {}).get("Retry-After")
    if retry_after is not None:
        body["error"]["retry_after"] = int(retry_after)
    await send({"type": "websocket.send", "text": json.dumps(body)})
    await send({"type": "websocket.close", "code": close_code, "reason": (error.code or "")[:120]})
