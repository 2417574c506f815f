"""Bodies of POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from kvtide.server.openai.common import OpenAIBaseModel

Name = Annotated[str, Field(min_length=1, max_length=256)]


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: Name
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: Name
    lora_int_id: int | None = None
