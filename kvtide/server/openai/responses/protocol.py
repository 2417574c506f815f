"""POST /v1/responses: the request body (OpenAI's Responses API, plus a few of vLLM's sampling
extras). Input items and content parts are read loosely here and checked by conversation.py,
which words the 400 for an item type this server does not serve."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kvtide.server.openai.common import Int64, OpenAIBaseModel


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class InputItem(OpenAIBaseModel):
    """Any input item: a message ({"role", "content"}, "type" optional), "function_call",
    "function_call_output" or "reasoning" (what a previous response's output holds)."""

    type: str | None = None
    id: str | None = None
    role: str | None = None
    content: str | list[ContentPart] | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None
    summary: list[ContentPart] | None = None


class FunctionTool(OpenAIBaseModel):
    """A tool as the Responses API writes it (flat: no nested "function" object)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(OpenAIBaseModel):
    type: str
    name: str | None = None


class TextFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None


class ResponsesRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    store: bool = True
    """Keep the response (GET /v1/responses/{id}, previous_response_id), unless the server runs
    with --disable-response-storage."""
    previous_response_id: str | None = None
    """Continue that stored response's conversation: its input and output come before `input`."""
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    """Accepted (effort, summary): the model reasons as its template and --reasoning-parser say."""
    truncation: Literal["auto", "disabled"] | None = None
    # vLLM's extras
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=1e6)] | None = None
    seed: Int64 | None = None
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    chat_template: str | None = None
    """A Jinja template for this request only (needs --trust-request-chat-template)."""
    chat_template_kwargs: dict[str, Any] | None = None
