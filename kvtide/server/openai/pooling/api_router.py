"""Routes: POST /v1/embeddings, /pooling, /classify, /score, /v1/score, /rerank, /v1/rerank,
/v2/rerank; and the guard that turns generation requests away from a pooling model."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvtide.server.errors import error_body, from_engine_error
from kvtide.server.openai.pooling import serving
from kvtide.server.openai.pooling.protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from kvtide.server.state import get_state

router = APIRouter()


async def _answer(work: Awaitable[Any]) -> Response:
    try:
        return JSONResponse((await work).model_dump(exclude_none=False))
    except Exception as e:
        return from_engine_error(e).response()


@router.post("/v1/embeddings")
async def create_embeddings(request: EmbeddingRequest, raw_request: Request) -> Response:
    return await _answer(serving.embeddings(get_state(raw_request), request))


@router.post("/pooling")
async def create_pooling(request: PoolingRequest, raw_request: Request) -> Response:
    return await _answer(serving.embeddings(get_state(raw_request), request, api="encode"))


@router.post("/classify")
async def create_classify(request: ClassificationRequest, raw_request: Request) -> Response:
    return await _answer(serving.classify(get_state(raw_request), request))


@router.post("/score")
@router.post("/v1/score")
async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
    return await _answer(serving.score(get_state(raw_request), request))


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def create_rerank(request: RerankRequest, raw_request: Request) -> Response:
    return await _answer(serving.rerank(get_state(raw_request), request))


GENERATION_PATHS = {"/v1/completions": "Completions API", "/v1/chat/completions": "Chat Completions API",
                    "/v1/responses": "Responses API"}
"""Endpoints a pooling model does not serve."""


class PoolingModelGuard:
    """ASGI middleware: a pooling model answers the generation endpoints with vLLM's 400
    ("The model does not support ... API") instead of running them."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        api = GENERATION_PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if api is not None:
            state = getattr(getattr(scope.get("app"), "state", None), "kvtide", None)
            info = getattr(getattr(state, "engine", None), "info", None)
            if getattr(info, "pooler", None) is not None:
                body = json.dumps(error_body(f"The model does not support {api}", "invalid_request_error",
                                             code="model_not_supported")).encode()
                await send({"type": "http.response.start", "status": 400,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
