"""Routes: POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API), answering
errors in Anthropic's shape."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from kvtide.server.anthropic.errors import error_response
from kvtide.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from kvtide.server.anthropic.serving import CHAT_PARAMS, MessagesServing
from kvtide.server.errors import OpenAIError, from_engine_error, validation_error
from kvtide.server.state import get_state


class AnthropicRoute(APIRoute):
    """A route whose every error, body validation included, is answered in Anthropic's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def anthropic_errors(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                return error_response(validation_error(e))
            except HTTPException as e:  # e.g. a body that is not JSON: its status, Anthropic's shape
                return error_response(OpenAIError(str(e.detail), e.status_code, headers=e.headers))
            except Exception as e:
                error: OpenAIError = from_engine_error(e)
                error.param = CHAT_PARAMS.get(error.param or "", error.param)
                return error_response(error)

        return anthropic_errors


router = APIRouter(route_class=AnthropicRoute)


@router.post("/v1/messages")
async def create_message(request: MessagesRequest, raw_request: Request) -> Response:
    return await MessagesServing(get_state(raw_request)).create(request, raw_request)


@router.post("/v1/messages/count_tokens")
async def count_message_tokens(request: CountTokensRequest, raw_request: Request) -> Response:
    return JSONResponse(await MessagesServing(get_state(raw_request)).count_tokens(request))
