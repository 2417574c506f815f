"""POST /v1/completions: request and response bodies (OpenAI's, plus vLLM's extras)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kvtide.server.limits import MAX_BEST_OF, MAX_N, MAX_TOP_LOGPROBS
from kvtide.server.openai.common import NonNegInt, OpenAIBaseModel, SamplingRequest, UsageInfo
from kvtide.server.openai.structured import StructuredOutputFields

PromptField = str | list[str] | list[NonNegInt] | list[list[NonNegInt]]


class CompletionRequest(SamplingRequest, StructuredOutputFields):
    prompt: PromptField
    """A string, a list of strings, token ids, or a list of token-id lists (one completion set each)."""
    suffix: str | None = None
    """Not supported (refused with 400 when non-empty)."""
    echo: bool = False
    """Prefix each choice with its prompt (text and, with logprobs, its tokens' logprobs; the
    latter non-streamed only)."""
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_BEST_OF)] | None = None
    """Only best_of == n (the default) is supported."""
    add_special_tokens: bool = True
    """Add the tokenizer's special tokens (BOS) to text prompts."""
    # Beam search (vLLM's extras): n is the beam width and every beam comes back, best first.
    use_beam_search: bool = False
    beam_width: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    """kvtide's extra: search this many beams (>= n) and return the n best (default: n)."""
    length_penalty: Annotated[float, Field(ge=-1e6, le=1e6)] = 1.0
    """A finished beam scores cumulative_logprob / generated_len ** length_penalty."""
    early_stopping: bool | Literal["never"] = False
    """HF's rule: True stops once beam_width beams finished; False when none can improve; "never"."""


class CompletionLogprobs(OpenAIBaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    """None for an echoed prompt's first token (nothing predicts it)."""
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    """With prompt_logprobs in the request (vLLM's shape, common.prompt_logprobs_body)."""


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """A prefill instance's handle on the prompt it staged for a decode instance (KV connectors);
    left out of the JSON when there is none."""

    def dump(self) -> dict[str, Any]:
        return self.model_dump()
