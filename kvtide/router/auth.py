"""--api-key: every route but GET /health needs 'Authorization: Bearer KEY' or 'x-api-key: KEY'
(compared in constant time); otherwise 401 with OpenAI's error object. The key is never logged."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from kvtide.router.errors import error_response

OPEN_PATHS = frozenset({"/health"})


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_response("missing or invalid API key: send 'Authorization: Bearer KEY'", 401,
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given: list[bytes] = []
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given.append(value[7:].strip())
            elif name == b"x-api-key":
                given.append(value.strip())
        return any(hmac.compare_digest(key, self._key) for key in given)
