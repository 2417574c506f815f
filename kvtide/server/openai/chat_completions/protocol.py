"""POST /v1/chat/completions: request and response bodies (OpenAI's, plus vLLM's extras)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from kvtide.server.limits import MAX_TOP_LOGPROBS
from kvtide.server.openai.common import OpenAIBaseModel, SamplingRequest, UsageInfo


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ResponseFormat(OpenAIBaseModel):
    type: str


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    """OpenAI's newer name for max_tokens; wins when both are given."""
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    """Alternatives per token (needs logprobs: true)."""
    add_generation_prompt: bool = True
    """End the rendered prompt with the assistant turn's opening (the template decides how)."""
    chat_template: str | None = None
    """A Jinja template for this request only."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the template."""
    response_format: ResponseFormat | None = None
    """Only {"type": "text"} is supported."""
    tools: list[Any] | None = None
    """Not supported (refused with 400 when non-empty)."""


class ChatLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatLogprobEntry] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
