"""POST /tokenize and POST /detokenize (vLLM's extras, not part of OpenAI's API)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from kvtide.server.openai.chat_completions.protocol import ChatMessage
from kvtide.server.openai.common import NonNegInt, OpenAIBaseModel


class TokenizeRequest(OpenAIBaseModel):
    """Either `prompt` (text) or `messages` (rendered with the chat template, as chat requests are)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    """For `prompt` only: add BOS etc. (chat prompts get theirs from the template)."""
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[NonNegInt]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
