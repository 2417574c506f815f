"""Route: POST /v1/lang/score (kvtide's extension for LLM programs)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvtide.server.errors import from_engine_error
from kvtide.server.openai.lang.protocol import ScoreRequest
from kvtide.server.openai.lang.serving import score_choices
from kvtide.server.state import get_state

router = APIRouter()


@router.post("/v1/lang/score")
async def score(request: ScoreRequest, raw_request: Request) -> Response:
    try:
        return await score_choices(get_state(raw_request), request, raw_request)
    except Exception as e:
        return from_engine_error(e).response()
