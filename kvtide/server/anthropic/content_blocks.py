"""A turn's deltas -> Anthropic content blocks, and the stream events that build them.

    reasoning  -> {"type": "thinking", "thinking", "signature": ""}   (thinking_delta)
    content    -> {"type": "text", "text"}                            (text_delta)
    tool calls -> {"type": "tool_use", "id", "name", "input"}, one per call (input_json_delta)

A block stays open while deltas of its kind arrive; another kind (or a new call) closes it. The
non-streamed message runs the same builder and keeps only the blocks, so a stream always adds up
to the whole message. A tool_use block's input is its JSON arguments decoded ({} if a cut answer
left them unreadable).
"""

from __future__ import annotations

import json
from typing import Any

from kvtide.server.openai.chat_completions.assembly import ChoiceDelta


def tool_use_id(call_id: str) -> str:
    """Anthropic's id style ("toolu_..."), from the call id the tool-call stream made."""
    return "toolu_" + call_id.removeprefix("call_")


class ContentBlocks:
    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._arguments: dict[int, str] = {}
        """Block index -> a tool_use block's JSON arguments as generated so far."""
        self._open: int | None = None
        self._open_call_index: int | None = None

    def feed(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            events += self._text("thinking", delta.reasoning)
        if delta.content:
            events += self._text("text", delta.content)
        for call in delta.tool_calls:
            events += self._call(call)
        return events

    def finish(self) -> list[dict[str, Any]]:
        return self._close()

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self.blocks[self._open]["type"] != kind:
            events += self._close()
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            events += self._start(block)
        assert self._open is not None
        self.blocks[self._open][kind] += text
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
            {"type": "text_delta", "text": text}
        events.append({"type": "content_block_delta", "index": self._open, "delta": delta})
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        if "id" in call:
            events += self._close()
            events += self._start({"type": "tool_use", "id": tool_use_id(call["id"]),
                                   "name": call["function"]["name"], "input": {}})
            self._open_call_index = call["index"]
            assert self._open is not None
            self._arguments[self._open] = ""
        elif self._open is None or self._open_call_index != call["index"]:
            return []  # the streams send a call's arguments before the next call starts
        arguments = call["function"].get("arguments") or ""
        if arguments:
            assert self._open is not None
            self._arguments[self._open] += arguments
            events.append({"type": "content_block_delta", "index": self._open,
                           "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return events

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self.blocks.append(block)
        self._open, self._open_call_index = len(self.blocks) - 1, None
        return [{"type": "content_block_start", "index": self._open, "content_block": dict(block)}]

    def _close(self) -> list[dict[str, Any]]:
        index = self._open
        if index is None:
            return []
        self._open, self._open_call_index = None, None
        if index in self._arguments:
            self.blocks[index]["input"] = _decode_input(self._arguments[index])
        return [{"type": "content_block_stop", "index": index}]


def _decode_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
