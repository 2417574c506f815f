"""What a program needs from a model, and the values passed across: a backend renders chat
messages, generates continuations of a prompt, and scores choices after a prompt.

A prompt is the state's text kept as pieces, each with the token ids that produced it when they are
known (a generation's own tokens): an in-process backend continues from those exact tokens, so the
KV it already computed matches the next call's prefix token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtide.lang.ops import Gen

Piece = tuple[str, "tuple[int, ...] | None"]


@dataclass(frozen=True)
class Prompt:
    pieces: tuple[Piece, ...]

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.pieces)

    def extended(self, text: str) -> Prompt:
        return Prompt(self.pieces + ((text, None),))


@dataclass
class GenResult:
    text: str
    token_ids: tuple[int, ...] | None
    """The generated tokens when they decode to exactly `text` (None: the text is re-tokenized with
    what follows it; e.g. a stop string cut the text inside a token, or the tokens end inside a
    character)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """prompt_tokens, completion_tokens, cached_tokens (prompt tokens the prefix cache served),
    finish_reason."""


@dataclass
class ScoreResult:
    token_logprobs: list[list[float]]
    """Per choice, the logprob of each of its tokens after the prompt."""
    meta: dict[str, Any] = field(default_factory=dict)


class Backend(Protocol):
    """The model a program runs on: `kl.Engine` (in-process) or `kl.Endpoint` (a kvtide server)."""

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The conversation as the model's chat template renders it (no generation prompt)."""
        ...

    def generate(self, prompts: list[Prompt], ops: list[Gen]) -> list[GenResult | Exception]:
        """One continuation per prompt, run together; a failed call is returned as its exception."""
        ...

    def generate_n(self, prompt: Prompt, op: Gen, n: int) -> list[GenResult]:
        """n continuations of one prompt as one request (SamplingParams.n: the engine computes the
        prompt once and forks its KV blocks; with a seed, continuation i samples with seed + i)."""
        ...

    def score(self, prompt: Prompt, choices: list[str]) -> ScoreResult:
        """The logprobs of each choice's tokens continuing `prompt`, computed in one batch."""
        ...


def common_prefix_len(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def choice_token_span(prefix_ids: list[int], full_ids: list[int], choice: str) -> int:
    """Where a choice's tokens start in the tokens of prompt + choice: after the tokens it shares
    with the prompt's own (a tokenizer may merge across the boundary, and the merged token then
    counts as the choice's)."""
    start = common_prefix_len(prefix_ids, full_ids)
    if start == 0:
        raise ValueError("select needs a non-empty state before the choices (the first token has no logprob)")
    if start == len(full_ids):
        raise ValueError(f"select: choice {choice!r} adds no tokens")
    return start
