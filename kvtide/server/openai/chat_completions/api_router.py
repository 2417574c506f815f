"""Route: POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvtide.server.errors import from_engine_error
from kvtide.server.openai.chat_completions.body_counts import CountedChatRoute
from kvtide.server.openai.chat_completions.protocol import ChatCompletionRequest
from kvtide.server.openai.chat_completions.serving import ChatServing
from kvtide.server.state import get_state

router = APIRouter(route_class=CountedChatRoute)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    try:
        return await ChatServing(get_state(raw_request)).create(request, raw_request)
    except Exception as e:
        return from_engine_error(e).response()
