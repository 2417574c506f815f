"""Routes: POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter (runtime adapter updates,
allowed by --allow-runtime-lora-updating or VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from kvtide.server.errors import OpenAIError, from_engine_error
from kvtide.server.openai.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from kvtide.server.state import ServerState, get_state

router = APIRouter()


def _check_allowed(state: ServerState) -> None:
    if not state.engine_serves_lora:
        raise OpenAIError("LoRA adapters need a server started with --enable-lora", 400, code="lora_disabled")
    if not state.loras.allow_runtime_updating:
        raise OpenAIError("runtime LoRA updates are off: start the server with --allow-runtime-lora-updating "
                          "(or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)", 404, code="not_found")


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
    state = get_state(raw_request)
    try:
        _check_allowed(state)
        await state.loras.load(state.engine, request.lora_name, request.lora_path)
    except Exception as e:
        return from_engine_error(e).response()
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw_request: Request) -> Response:
    state = get_state(raw_request)
    try:
        _check_allowed(state)
        await state.loras.unload(state.engine, request.lora_name)
    except Exception as e:
        return from_engine_error(e).response()
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")
