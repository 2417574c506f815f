"""POST /v1/chat/completions: request and response bodies (OpenAI's, plus vLLM's extras)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kvtide.server.limits import MAX_TOP_LOGPROBS
from kvtide.server.openai.common import OpenAIBaseModel, SamplingRequest, UsageInfo
from kvtide.server.openai.structured import StructuredOutputFields


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str
    """JSON text, as OpenAI sends it."""


class MessageToolCall(OpenAIBaseModel):
    id: str
    type: str = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    """An assistant turn's calls (given back to the template with the conversation)."""
    tool_call_id: str | None = None
    """A "tool" turn: the call this is the result of."""
    reasoning_content: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of an object; none means no arguments."""
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: str
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: str
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest, StructuredOutputFields):
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
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: "auto" when tools are given (vLLM's rule), else "none"."""
    parallel_tool_calls: bool = True
    """False: at most one call per answer."""
    include_reasoning: bool = True
    """With --reasoning-parser: false drops reasoning_content from the response."""


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
    reasoning_content: str | None = None
    tool_calls: list[MessageToolCall] = Field(default_factory=list)


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
    kv_transfer_params: dict[str, Any] | None = None
    """A prefill instance's handle on the prompt it staged for a decode instance (KV connectors);
    left out of the JSON when there is none."""
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    """With prompt_logprobs in the request (vLLM's shape, common.prompt_logprobs_body)."""
