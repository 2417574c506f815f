"""Mistral tool calls: text, then [TOOL_CALLS] and the calls, in either of two forms.

    Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (v0.3 tokenizer)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}          (v11+ tokenizers)

Rules:
- Text outside the calls is content. Each [TOOL_CALLS] is followed by a non-empty JSON array of
  {"name": str, "arguments": {...}} objects, or by a name ([A-Za-z0-9_.-]+), [ARGS] (may be
  absent, as when special tokens were skipped) and a JSON object.
- A [TOOL_CALLS] not followed by a well-formed call (bad JSON, an empty array, a missing name,
  a cut-off value) is content up to where it went wrong, marker included; scanning goes on there.
"""

from __future__ import annotations

import re

from kvtide.tool_parsers.base import (
    Event,
    StreamingToolParser,
    ToolCall,
    ToolParser,
    call_from_object,
    canonical_arguments,
    load_json,
)
from kvtide.tool_parsers.scan import BracketMatcher, partial_tag_len, skip_space

CALLS_TAG = "[TOOL_CALLS]"
ARGS_TAG = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


class MistralToolParser(ToolParser):
    name = "mistral"

    def streaming(self) -> StreamingToolParser:
        return _MistralStream()


def _parse_array(text: str) -> list[ToolCall] | None:
    try:
        items = load_json(text)
        if not isinstance(items, list) or not items:
            return None
        calls = [call_from_object(item) for item in items]
    except Exception:  # bad JSON, absurd nesting: not calls
        return None
    return None if None in calls else calls  # type: ignore[return-value]


def _parse_arguments(name: str, text: str) -> ToolCall | None:
    try:
        arguments = load_json(text)
        return ToolCall(name, canonical_arguments(arguments)) if isinstance(arguments, dict) else None
    except Exception:
        return None


class _MistralStream(StreamingToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        """Undecided text; after a [TOOL_CALLS] it is what follows the marker."""
        self._pos = 0
        self._state = "outside"
        """outside -> marker -> (array | name -> args_tag -> args_value -> args_object) -> outside."""
        self._name = ""
        self._matcher: BracketMatcher | None = None

    def _scan(self, delta_text: str, final: bool) -> list[Event]:
        self._buffer += delta_text
        events: list[Event] = []
        while self._step(events):
            pass
        if final and self._state != "outside":  # a call cut off by the end of the output
            self._malformed(events, len(self._buffer))
        if final:
            events.append(self._buffer)
            self._buffer = ""
        return events

    def _step(self, events: list[Event]) -> bool:
        """Decide the next stretch of the buffer; False when the rest must wait for more text."""
        buffer, state = self._buffer, self._state
        if state == "outside":
            start = buffer.find(CALLS_TAG)
            if start < 0:
                keep = partial_tag_len(buffer, CALLS_TAG)
                events.append(buffer[: len(buffer) - keep])
                self._buffer = buffer[len(buffer) - keep :]
                return False
            events.append(buffer[:start])
            self._buffer, self._pos, self._state = buffer[start + len(CALLS_TAG) :], 0, "marker"
            return True
        if state in ("array", "args_object"):
            assert self._matcher is not None
            end = self._matcher.scan(buffer)
            if end is None:
                return False
            value = buffer[self._matcher.start : end]
            calls = _parse_array(value) if state == "array" else _parse_arguments(self._name, value)
            if calls is None:
                self._malformed(events, end)
            else:
                events.extend(calls if isinstance(calls, list) else [calls])
                self._buffer, self._state = buffer[end:], "outside"
            return True
        if state == "name":
            end = _NAME.match(buffer, self._pos).end()  # type: ignore[union-attr]
            if end == len(buffer):
                return False
            if end == self._pos:
                self._malformed(events, end)
                return True
            self._name, self._pos, self._state = buffer[self._pos : end], end, "args_tag"
            return True
        if state == "args_tag":
            rest = buffer[self._pos :]
            if rest.startswith(ARGS_TAG):
                self._pos, self._state = self._pos + len(ARGS_TAG), "args_value"
                return True
            if ARGS_TAG.startswith(rest):
                return False
            self._state = "args_value"
            return True
        pos = skip_space(buffer, self._pos)
        if pos == len(buffer):
            return False
        if state == "marker" and buffer[pos] == "[":
            self._matcher, self._state = BracketMatcher(pos), "array"
        elif state == "marker":
            self._pos, self._state = pos, "name"
        elif buffer[pos] == "{":
            self._matcher, self._state = BracketMatcher(pos), "args_object"
        else:
            self._malformed(events, pos)
        return True

    def _malformed(self, events: list[Event], end: int) -> None:
        """The marker and buffer[:end] were not a call: content, and scanning goes on at `end`."""
        events.append(CALLS_TAG + self._buffer[:end])
        self._buffer, self._state = self._buffer[end:], "outside"
