"""The server's tool-call and reasoning parsers (--tool-call-parser, --reasoning-parser), made once
at startup against the engine's tokenizer, so a configuration that cannot work fails there and
not on the first request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtide.reasoning import ReasoningParser, get_reasoning_parser
from kvtide.tool_parsers import ToolParser, get_tool_parser

SPECIAL_MARKER_TOOL_PARSERS = ("mistral", "llama3_json", "openai")
"""Formats whose markers ([TOOL_CALLS], <|python_tag|>, harmony's <|channel|>) are special tokens in their models'
tokenizers: their requests are detokenized with special tokens kept, or the parser never sees them."""


@dataclass
class OutputParsers:
    tool_parser: ToolParser | None = None
    tool_parser_name: str | None = None
    reasoning_parser: ReasoningParser | None = None
    reasoning_end_token_ids: list[int] | None = None
    """The reasoning end tag as token ids: structured output waits for them (the engine matches ids)."""
    reasoning_tags_special: bool = False
    """The tokenizer has the reasoning tags as special tokens: keep special tokens in the text."""

    @property
    def auto_tool_choice(self) -> bool:
        return self.tool_parser is not None

    @classmethod
    def create(cls, tokenizer: Any, tool_call_parser: str | None, enable_auto_tool_choice: bool,
               reasoning_parser: str | None) -> OutputParsers:
        """ValueError (a startup error) for an unknown name, --enable-auto-tool-choice without
        --tool-call-parser, or a reasoning end tag this tokenizer cannot write."""
        check_flags(tool_call_parser, enable_auto_tool_choice, reasoning_parser)
        parsers = cls()
        if tool_call_parser is not None and enable_auto_tool_choice:
            parsers.tool_parser = get_tool_parser(tool_call_parser)(tokenizer)
            parsers.tool_parser_name = tool_call_parser
        if reasoning_parser is not None:
            parser = get_reasoning_parser(reasoning_parser)(tokenizer)
            parsers.reasoning_parser = parser
            parsers.reasoning_end_token_ids = _tag_token_ids(tokenizer, parser.end_tag, reasoning_parser)
            special = set(getattr(tokenizer, "all_special_tokens", ()) or ())
            parsers.reasoning_tags_special = any(m in special for m in parser.markers or (parser.start_tag,
                                                                                          parser.end_tag))
        return parsers


def check_flags(tool_call_parser: str | None, enable_auto_tool_choice: bool, reasoning_parser: str | None) -> None:
    """The checks that need no tokenizer (run before the model loads)."""
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (the model's tool-call format)")
    if tool_call_parser is not None:
        get_tool_parser(tool_call_parser)
    if reasoning_parser is not None:
        get_reasoning_parser(reasoning_parser)


def _tag_token_ids(tokenizer: Any, tag: str, parser_name: str) -> list[int]:
    ids = list(tokenizer.encode(tag, add_special_tokens=False))
    unk = getattr(tokenizer, "unk_token_id", None)
    decoded = tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
    if not ids or (unk is not None and unk in ids) or decoded.strip() != tag:
        raise ValueError(f"--reasoning-parser {parser_name}: this model's tokenizer cannot write the end tag "
                         f"{tag!r} (it encodes to {ids}); is this a {parser_name} model?")
    return ids
