"""Scoring and reranking semantics shared by `LLM.score` and the server's /score and /rerank
(no torch): which pairs a request names, how a cross-encoder's pair is tokenized, and how
truncation cuts a prompt."""

from __future__ import annotations

from collections.abc import Sequence


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 against every text_2 (one-to-many), or lists of equal length
    paired in order (one-to-one). ValueError otherwise."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise ValueError("text_1 and text_2 must not be empty")
    for name, texts in (("text_1", first), ("text_2", second)):
        if not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{name} must be a string or a list of strings")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"text_1 and text_2 must pair one-to-one or one-to-many: got {len(first)} and "
                         f"{len(second)} texts")
    return list(zip(first, second, strict=True))


def check_truncation(truncate_prompt_tokens: int | None, max_prompt_len: int) -> int | None:
    """The number of tokens to keep (-1: the longest prompt the model takes), or None: no truncation."""
    if truncate_prompt_tokens is None:
        return None
    if isinstance(truncate_prompt_tokens, bool) or not isinstance(truncate_prompt_tokens, int):
        raise ValueError("truncate_prompt_tokens must be an integer")
    if truncate_prompt_tokens == -1:
        return max_prompt_len
    if truncate_prompt_tokens < 1:
        raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {truncate_prompt_tokens}")
    if truncate_prompt_tokens > max_prompt_len:
        raise ValueError(f"truncate_prompt_tokens ({truncate_prompt_tokens}) must be at most the longest prompt "
                         f"the model takes ({max_prompt_len} tokens)")
    return truncate_prompt_tokens


def tokenize_text(tokenizer, text: str, second: str | None = None, keep: int | None = None) -> list[int]:
    """A text (or a cross-encoder's pair, with the tokenizer's pair template) as token ids; with
    `keep`, cut to that many as the tokenizer truncates (its truncation side)."""
    if not isinstance(text, str) or not text or (second is not None and (not isinstance(second, str) or not second)):
        raise ValueError("input must be a non-empty string")
    if tokenizer is None:
        raise ValueError("a text input needs the model's tokenizer")
    kwargs = {"truncation": True, "max_length": keep} if keep is not None else {}
    return list(tokenizer(text, second, **kwargs)["input_ids"]) if second is not None else \
        list(tokenizer(text, **kwargs)["input_ids"])


def truncate_ids(token_ids: list[int], keep: int | None) -> list[int]:
    """Token id inputs keep their last `keep` tokens (vLLM's rule for pre-tokenized prompts)."""
    return list(token_ids) if keep is None else list(token_ids)[-keep:]
