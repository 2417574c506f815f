"""Request bodies of /v1/batches (the file routes take multipart forms and path ids)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from kvtide.server.openai.common import OpenAIBaseModel


class CreateBatchRequest(OpenAIBaseModel):
    input_file_id: Annotated[str, Field(min_length=1, max_length=256)]
    endpoint: Annotated[str, Field(min_length=1, max_length=256)]
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
