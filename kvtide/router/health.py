"""The health loop: GET /health on every backend each interval. A connection error, a timeout
(HEALTH_CHECK_TIMEOUT_S) or any status but 200 ejects the backend (a draining `kvtide serve`
answers 503); the next 200 re-admits it."""

from __future__ import annotations

import asyncio
import logging

import httpx

from kvtide.router.backends import Backend
from kvtide.router.state import RouterState

logger = logging.getLogger("kvtide.router")


async def probe(state: RouterState, backend: Backend) -> bool:
    try:
        response = await state.health_http.get(backend.url + "/health")
    except httpx.HTTPError as e:
        state.eject(backend, f"health check failed: {type(e).__name__}")
        return False
    if response.status_code != 200:
        state.eject(backend, f"health check answered {response.status_code}")
        return False
    state.admit(backend)
    return True


async def check_all(state: RouterState) -> None:
    await asyncio.gather(*(probe(state, b) for b in state.backends.values()))


async def health_loop(state: RouterState) -> None:
    """Runs until cancelled (the app's shutdown)."""
    while True:
        await asyncio.sleep(state.settings.health_check_interval)
        try:
            await check_all(state)
        except Exception:  # one bad round must not end the loop that re-admits backends
            logger.exception("health check round failed")
