"""Routes: POST /tokenize, POST /detokenize."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvtide.server.errors import from_engine_error
from kvtide.server.openai.tokenize import serving
from kvtide.server.openai.tokenize.protocol import DetokenizeRequest, TokenizeRequest
from kvtide.server.state import get_state

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: TokenizeRequest, raw_request: Request) -> Response:
    try:
        return JSONResponse((await serving.tokenize(get_state(raw_request), request)).model_dump())
    except Exception as e:
        return from_engine_error(e).response()


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
    try:
        return JSONResponse(serving.detokenize(get_state(raw_request), request).model_dump())
    except Exception as e:
        return from_engine_error(e).response()
