"""Route: POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvtide.server.errors import from_engine_error
from kvtide.server.openai.completions.protocol import CompletionRequest
from kvtide.server.openai.completions.serving import CompletionServing
from kvtide.server.state import get_state

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    try:
        return await CompletionServing(get_state(raw_request)).create(request, raw_request)
    except Exception as e:
        return from_engine_error(e).response()
