"""POST /v1/lang/score: request and response bodies (a kvtide extension, not OpenAI's)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from kvtide.server.openai.common import NonNegInt, OpenAIBaseModel

MAX_SCORE_CHOICES = 64
"""Choices scored by one request: each is one engine request."""
MAX_CHOICE_CHARS = 1024


class ScoreRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[NonNegInt], Field(min_length=1)]
    """Text (tokenized with add_special_tokens) or token ids: what the choices continue."""
    choices: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]],
                       Field(min_length=1, max_length=MAX_SCORE_CHOICES)]
    add_special_tokens: bool = False
    """Add the tokenizer's special tokens (BOS) to a text prompt (a rendered chat template holds its own)."""
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0
    cache_salt: Annotated[str, Field(min_length=1)] | None = None


class ScoredChoice(OpenAIBaseModel):
    index: int
    text: str
    token_ids: list[int]
    """The choice's tokens: those of prompt + choice after the ones shared with the prompt's own."""
    token_logprobs: list[float]
    """The logprob of each of those tokens, given everything before it."""
    normalized_logprob: float
    """The mean of token_logprobs (SGLang's token-length-normalized score)."""
    prompt_tokens: int
    """Tokens of prompt + choice."""
    cached_tokens: int
    """Of those, the tokens the prefix cache served."""


class ScoreResponse(OpenAIBaseModel):
    object: str = "lang.score"
    model: str
    prompt_tokens: int
    choices: list[ScoredChoice]
