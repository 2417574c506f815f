"""Reasoning parsers: a thinking model's text -> reasoning_content and content, streamed or whole.

Pure Python (no torch, no model): the server picks one with --reasoning-parser.
"""

from __future__ import annotations

from kvtide.reasoning.base import ReasoningParser, StreamingReasoningParser
from kvtide.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from kvtide.reasoning.gpt_oss import GptOssReasoningParser
from kvtide.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, GptOssReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered under `name`; ValueError naming the choices otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of: {', '.join(sorted(REASONING_PARSERS))}"
        ) from None


__all__ = ["REASONING_PARSERS", "ReasoningParser", "StreamingReasoningParser", "get_reasoning_parser"]
