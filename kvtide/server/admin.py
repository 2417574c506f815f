"""The admin key (--admin-api-key): the one credential for the routes that expose the engine's
internals or change server-wide state; a client key (--api-key, --api-keys-file) opens them only
if it is the admin key itself.

    /internal/*        engine stats and integrity checks: only with an admin key set (404 without)
    ADMIN_ROUTES       --enable-admin-api's routes: the admin key when one is set, else --api-key

AdminGate sits in front of the server's guard. On an admin path with an admin key set it checks
that key (403 for a client key, 401 for none or an unknown one) and marks the scope
ADMIN_SCOPE_KEY, so that the guard
and the quotas let the request through without a client key: the admin key alone suffices, and a
quota key never reaches these routes. Every other request passes untouched.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtide.server.asgi import (
    ADMIN_SCOPE_KEY,
    WS_CLOSE_POLICY,
    Receive,
    Scope,
    Send,
    api_key_from_headers,
    invalid_api_key,
    reject_websocket,
    send_error,
)
from kvtide.server.errors import OpenAIError

if TYPE_CHECKING:
    from kvtide.server.state import ServerSettings

INTERNAL_PREFIX = "/internal/"
"""Routes for tests and debugging (engine stats, KV integrity checks)."""
ADMIN_ROUTES = ("/reset_prefix_cache", "/sleep", "/wake_up", "/is_sleeping", "/update_weights_from_disk")
"""Routes of --enable-admin-api, and of --enable-sleep-mode (server/sleep_mode.py)."""


def is_admin_path(path: str) -> bool:
    return path.startswith(INTERNAL_PREFIX) or path in ADMIN_ROUTES


class AdminGate:
    """Checks the admin key on admin paths (module docstring); a plain ASGI middleware."""

    def __init__(self, app: Callable, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings
        self._key = settings.admin_api_key.encode() if settings.admin_api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._key is None or scope["type"] not in ("http", "websocket") or not is_admin_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        presented = api_key_from_headers(headers)
        # Constant time in the key's content: timing must not reveal a prefix.
        if presented and hmac.compare_digest(presented, self._key):
            await self.app({**scope, ADMIN_SCOPE_KEY: True}, receive, send)
            return
        error = OpenAIError("This route needs the admin API key (--admin-api-key)", 403, code="permission_denied",
                            error_type="permission_error") if self._is_client_key(presented) else invalid_api_key()
        if scope["type"] == "websocket":
            await reject_websocket(receive, send, error, WS_CLOSE_POLICY)
        else:
            await send_error(send, error)

    def _is_client_key(self, presented: bytes) -> bool:
        """Whether `presented` is --api-key's key or one of --api-keys-file's (constant time)."""
        if not presented:
            return False
        api_key, api_keys = self.settings.api_key, self.settings.api_keys
        if api_key is not None and hmac.compare_digest(presented, api_key.encode()):
            return True
        return api_keys is not None and api_keys.lookup(presented) is not None
