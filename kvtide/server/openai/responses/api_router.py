"""Routes: POST /v1/responses, GET and DELETE /v1/responses/{id}."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvtide.server.errors import from_engine_error
from kvtide.server.openai.responses.protocol import ResponsesRequest
from kvtide.server.openai.responses.serving import ResponsesServing, not_found, rename_param
from kvtide.server.state import get_state

router = APIRouter()


@router.post("/v1/responses")
async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
    try:
        return await ResponsesServing(get_state(raw_request)).create(request, raw_request)
    except Exception as e:
        return rename_param(from_engine_error(e)).response()


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, raw_request: Request) -> Response:
    stored = get_state(raw_request).response_store.get(response_id)
    if stored is None:
        return not_found(response_id).response()
    return JSONResponse(stored.body)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, raw_request: Request) -> Response:
    if not get_state(raw_request).response_store.delete(response_id):
        return not_found(response_id).response()
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
