"""Tool-call parsers: a model's text -> OpenAI tool calls and content, streamed or whole, by name.

Pure Python (no torch, no model): the server picks one with --tool-call-parser.
"""

from __future__ import annotations

from kvtide.tool_parsers.base import (
    DeltaMessage,
    ExtractedToolCalls,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    make_tool_call_id,
)
from kvtide.tool_parsers.harmony import OpenAIToolParser
from kvtide.tool_parsers.hermes import HermesToolParser
from kvtide.tool_parsers.llama3_json import Llama3JsonToolParser
from kvtide.tool_parsers.mistral import MistralToolParser
from kvtide.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, OpenAIToolParser,
                   PythonicToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under `name`; ValueError naming the choices otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; choose one of: {', '.join(sorted(TOOL_PARSERS))}"
        ) from None


__all__ = [
    "TOOL_PARSERS",
    "DeltaMessage",
    "ExtractedToolCalls",
    "StreamingToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
    "make_tool_call_id",
]
