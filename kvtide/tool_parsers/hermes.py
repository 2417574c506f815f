"""Hermes-style calls (Qwen2.5, Qwen3, Hermes, SmolLM): JSON objects between tags, text around them.

    Let me check both cities.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Tokyo"}}
    </tool_call>

Rules:
- A block whose body is not one {"name": str, "arguments": {...}} object is content, tags and all.
- A final block the model left unterminated (it often stops at EOS right after the JSON) is a call
  if its body is a well-formed call, content otherwise.
- A second <tool_call> before the closing tag means the first was prose ("use the <tool_call>
  tag"): the first is content and the block starts again at the second.
"""

from __future__ import annotations

from kvtide.tool_parsers.base import Event, StreamingToolParser, ToolParser, parse_call_json
from kvtide.tool_parsers.scan import partial_tag_len

START_TAG = "<tool_call>"
END_TAG = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def streaming(self) -> StreamingToolParser:
        return _HermesStream()


class _HermesStream(StreamingToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        """Undecided text; inside a block it is what follows the start tag."""
        self._in_block = False
        self._searched = 0
        """How much of the block's buffer is known to hold no complete tag."""

    def _scan(self, delta_text: str, final: bool) -> list[Event]:
        self._buffer += delta_text
        events: list[Event] = []
        while self._step(events, final):
            pass
        return events

    def _step(self, events: list[Event], final: bool) -> bool:
        """Decide the next stretch of the buffer; False when the rest must wait for more text."""
        buffer = self._buffer
        if not self._in_block:
            start = buffer.find(START_TAG)
            if start < 0:
                keep = 0 if final else partial_tag_len(buffer, START_TAG)
                events.append(buffer[: len(buffer) - keep])
                self._buffer = buffer[len(buffer) - keep :]
                return False
            events.append(buffer[:start])
            self._buffer = buffer[start + len(START_TAG) :]
            self._in_block = True
            return True
        search_from = max(0, self._searched - len(END_TAG) + 1)  # a tag may straddle the old end
        end = buffer.find(END_TAG, search_from)
        restart = buffer.find(START_TAG, search_from)
        if restart >= 0 and (end < 0 or restart < end):
            events.append(START_TAG + buffer[:restart])
            self._buffer, self._searched = buffer[restart + len(START_TAG) :], 0
            return True
        if end < 0 and not final:
            self._searched = len(buffer)
            return False
        self._searched = 0
        block = buffer if end < 0 else buffer[: end + len(END_TAG)]
        body = buffer if end < 0 else buffer[:end]
        events.append(parse_call_json(body.strip()) or START_TAG + block)
        self._buffer = buffer[len(block) :]
        self._in_block = False
        return bool(self._buffer)
