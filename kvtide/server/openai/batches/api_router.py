"""Routes: /v1/files (upload, get, content, delete, list) and /v1/batches (create, get, list, cancel)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from kvtide.server.errors import OpenAIError
from kvtide.server.openai.batches.multipart import parse_form
from kvtide.server.openai.batches.protocol import CreateBatchRequest
from kvtide.server.openai.batches.serving import BatchService
from kvtide.server.state import get_state

router = APIRouter()
"""Errors are the app's: OpenAIError, ValueError (400) and anything else through
server/errors.py's handlers, as on every other route."""


def batch_service(raw_request: Request) -> BatchService:
    """The app's BatchService, made on first use (its stores then load what is on disk)."""
    app = raw_request.app
    service = getattr(app.state, "kvtide_batches", None)
    if service is None:
        service = app.state.kvtide_batches = BatchService(app, get_state(raw_request).settings.batch)
    return service


@router.post("/v1/files")
async def upload_file(raw_request: Request) -> Response:
    form = parse_form(raw_request.headers.get("content-type"), await raw_request.body())
    if "file" not in form or form["file"].filename is None:
        raise OpenAIError("file: missing (send it as a multipart file field)", 400, param="file")
    if "purpose" not in form:
        raise OpenAIError("purpose: missing", 400, param="purpose")
    purpose = form["purpose"].value.decode("utf-8", "replace")
    upload = form["file"]
    return JSONResponse(await batch_service(raw_request).upload(upload.value, upload.filename or "", purpose))


@router.get("/v1/files")
async def list_files(raw_request: Request, purpose: str | None = None) -> Response:
    return JSONResponse(batch_service(raw_request).list_files(purpose))


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, raw_request: Request) -> Response:
    return JSONResponse(batch_service(raw_request).file(file_id))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, raw_request: Request) -> Response:
    return FileResponse(batch_service(raw_request).file_path(file_id), media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, raw_request: Request) -> Response:
    return JSONResponse(batch_service(raw_request).delete_file(file_id))


@router.post("/v1/batches")
async def create_batch(request: CreateBatchRequest, raw_request: Request) -> Response:
    return JSONResponse(await batch_service(raw_request).create_batch(
        request.input_file_id, request.endpoint, request.completion_window, request.metadata))


@router.get("/v1/batches")
async def list_batches(raw_request: Request, after: str | None = None,
                       limit: Annotated[int, Query(ge=1, le=100)] = 20) -> Response:
    return JSONResponse(batch_service(raw_request).list_batches(after, limit))


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, raw_request: Request) -> Response:
    return JSONResponse(batch_service(raw_request).get_batch(batch_id))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, raw_request: Request) -> Response:
    return JSONResponse(batch_service(raw_request).cancel_batch(batch_id))
