"""Sleep mode over HTTP (`kvtide serve --enable-sleep-mode`): vLLM's POST /sleep?level=1|2, POST
/wake_up and GET /is_sleeping, and SGLang's POST /update_weights_from_disk {"model_path": ...}, for
RL frameworks that train between rollouts on the same machine (worker/sleep_mode.py does the work).

They are admin paths (server/admin.py): behind --admin-api-key when it is set, else --api-key. While
requests are in flight /sleep and /update_weights_from_disk answer 409 and change nothing; while
the engine sleeps the API's /v1/ routes answer 503 with Retry-After (SleepGate), and /health stays
200: a sleeping engine is not a dead one.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from kvtide.server.errors import OpenAIError, error_response
from kvtide.server.state import get_state

ROUTES = ("/sleep", "/wake_up", "/is_sleeping", "/update_weights_from_disk")
RETRY_AFTER_S = 5

router = APIRouter()


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str


def _refused(e: ValueError) -> OpenAIError:
    message = str(e)
    busy = "in flight" in message
    return OpenAIError(message, 409 if busy else 400, code="conflict" if busy else None)


@router.post("/sleep")
async def sleep(raw_request: Request, level: int = 1) -> JSONResponse:
    state = get_state(raw_request)
    try:
        state.sleep_level = await state.engine.sleep(level)
    except ValueError as e:
        raise _refused(e) from None
    return JSONResponse({"is_sleeping": True, "level": state.sleep_level})


@router.post("/wake_up")
async def wake_up(raw_request: Request) -> JSONResponse:
    state = get_state(raw_request)
    try:
        state.sleep_level = await state.engine.wake_up()
    except ValueError as e:
        raise _refused(e) from None
    return JSONResponse({"is_sleeping": False})


@router.get("/is_sleeping")
async def is_sleeping(raw_request: Request) -> JSONResponse:
    state = get_state(raw_request)
    state.sleep_level = await state.engine.sleep_level()
    return JSONResponse({"is_sleeping": bool(state.sleep_level)})


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateWeightsRequest, raw_request: Request) -> JSONResponse:
    state = get_state(raw_request)
    try:
        version = await state.engine.update_weights_from_disk(body.model_path)
    except ValueError as e:
        raise _refused(e) from None
    return JSONResponse({"success": True, "message": f"weights loaded from {body.model_path}",
                         "weight_version": version})


class SleepGate:
    """While the engine sleeps, the API (/v1/...) answers 503 with Retry-After; a plain ASGI middleware."""

    def __init__(self, app: Any, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.state.sleep_level and scope["path"].startswith("/v1/"):
            response = error_response(503, f"the engine is asleep (level {self.state.sleep_level}): POST /wake_up "
                                           f"first", code="unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
