"""Llama 3.1 / 3.2 JSON tool calling: the whole output is calls, or it is all content.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", ...}

Rules:
- After optional whitespace and one optional <|python_tag|>, the output must be one or more
  {"name": str, "parameters": {...}} objects ("arguments" is accepted too) separated by ";" (a
  trailing ";" is tolerated), with nothing else but whitespace.
- Anything else anywhere makes the whole output content, verbatim (tag included).

Since a stray word after the last object would turn every call back into content, the calls go
out only at finish(); text is streamed as content as soon as it cannot be calls (it does not
start with "{", or an object is not a call).
"""

from __future__ import annotations

from kvtide.tool_parsers.base import StreamingToolParser, ToolParser, WholeOutputStream, parse_call_json
from kvtide.tool_parsers.scan import BracketMatcher, skip_space

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def streaming(self) -> StreamingToolParser:
        return _Llama3JsonStream()


class _Llama3JsonStream(WholeOutputStream):
    def __init__(self) -> None:
        super().__init__()
        # states: head -> object -> separator [-> after_semicolon -> object ...]; or content, for good.
        self._tag_seen = False
        self._matcher: BracketMatcher | None = None

    def _complete(self) -> bool:
        return self._state in ("separator", "after_semicolon")

    def _step(self) -> bool:
        text = self._text
        if self._state == "object":
            assert self._matcher is not None
            end = self._matcher.scan(text)
            if end is None:
                return False
            call = parse_call_json(text[self._matcher.start : end], ("parameters", "arguments"))
            if call is None:
                self._state = "content"
                return False
            self._calls.append(call)
            self._pos, self._state = end, "separator"
            return True
        pos = skip_space(text, self._pos)
        if pos == len(text):
            return False
        rest = text[pos:]
        if self._state == "head" and not self._tag_seen:
            if rest.startswith(PYTHON_TAG):
                self._tag_seen, self._pos = True, pos + len(PYTHON_TAG)
                return True
            if PYTHON_TAG.startswith(rest):
                return False
        if self._state == "separator" and rest[0] == ";":
            self._pos, self._state = pos + 1, "after_semicolon"
            return True
        if self._state in ("head", "after_semicolon") and rest[0] == "{":
            self._matcher, self._state = BracketMatcher(pos), "object"
            return True
        self._state = "content"
        return False
