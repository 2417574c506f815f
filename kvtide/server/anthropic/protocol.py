"""POST /v1/messages: the request body of Anthropic's Messages API. Content blocks are read
loosely here and checked by conversation.py, which words the 400 for a block this server does
not serve (images, documents, server tools)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kvtide.server.openai.common import OpenAIBaseModel


class ContentBlock(OpenAIBaseModel):
    """Any block: "text", "tool_use", "tool_result", "thinking" (others are refused)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None


class Message(OpenAIBaseModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(OpenAIBaseModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None
    """None or "custom": a client tool; Anthropic's server tools (web search, bash, ...) are refused."""


class ToolChoice(OpenAIBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(OpenAIBaseModel):
    model: str
    max_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[ContentBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    """Accepted: the model reasons as its template and --reasoning-parser say; its reasoning comes
    back as "thinking" blocks."""
    # vLLM's extras
    chat_template: str | None = None
    """A Jinja template for this request only (needs --trust-request-chat-template)."""
    chat_template_kwargs: dict[str, Any] | None = None


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages body without max_tokens."""

    max_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None  # type: ignore[assignment]
