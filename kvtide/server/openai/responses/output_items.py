"""A turn's deltas -> the Responses API's output items, and the typed stream events that build them.

    reasoning  -> {"type": "reasoning", "content": [{"type": "reasoning_text", ...}]}
    content    -> {"type": "message", "content": [{"type": "output_text", ...}]}
    tool calls -> {"type": "function_call", "call_id", "name", "arguments"}, one per call

An item stays open while deltas of its kind arrive; a delta of another kind (or a new call)
closes it. The non-streamed response runs the same builder and keeps only the items, so the
events of a stream always add up to the response's output. Events come back without
"sequence_number", which the stream numbers as it sends them.
"""

from __future__ import annotations

import uuid
from typing import Any

from kvtide.server.openai.chat_completions.assembly import ChoiceDelta


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._open_call_index: int | None = None

    @property
    def reasoning_text(self) -> str:
        return "".join(part["text"] for item in self.items if item["type"] == "reasoning" for part in item["content"])

    def feed(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.tool_calls:
            events += self._call(call)
        return events

    def finish(self, status: str) -> list[dict[str, Any]]:
        """Close the last item with `status` ("completed" or "incomplete"); an answer with no item
        at all gets an empty message, as OpenAI's does."""
        events = [] if self.items else self._open_item("message")
        return events + self._close(status)

    # ---- items -----------------------------------------------------------------------------
    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed") + self._open_item(kind)
        item = self._open
        assert item is not None
        item["content"][0]["text"] += text
        event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        events.append({"type": event, **self._where(), "content_index": 0, "delta": text,
                       **({} if kind == "reasoning" else {"logprobs": []})})
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        arguments = call["function"].get("arguments") or ""
        if "id" in call:  # a new call starts
            events += self._close("completed")
            item = {"id": item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": ""}
            self._open, self._open_call_index = item, call["index"]
            self.items.append(item)
            events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                           "item": dict(item)})
        elif self._open is None or self._open_call_index != call["index"]:
            return []  # the streams send a call's arguments before the next call starts
        if arguments:
            self._open["arguments"] += arguments
            events.append({"type": "response.function_call_arguments.delta", **self._where(), "delta": arguments})
        return events

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        if kind == "reasoning":
            item = {"id": item_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress", "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.items.append(item)
        self._open, self._open_call_index = item, None
        events = [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                   "item": {**item, "content": []}},
                  {"type": "response.content_part.added", **self._where(), "content_index": 0, "part": dict(part)}]
        item["content"].append(part)
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        self._open, self._open_call_index = None, None
        item["status"] = status
        where = self._where(item)
        events: list[dict[str, Any]] = []
        if item["type"] == "function_call":
            events.append({"type": "response.function_call_arguments.done", **where, "name": item["name"],
                           "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            if item["type"] == "reasoning":
                events.append({"type": "response.reasoning_text.done", **where, "content_index": 0,
                               "text": part["text"]})
            else:
                events.append({"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"],
                               "logprobs": []})
            events.append({"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)})
        events.append({"type": "response.output_item.done", "output_index": where["output_index"],
                       "item": _copy(item)})
        return events

    def _where(self, item: dict[str, Any] | None = None) -> dict[str, Any]:
        item = item if item is not None else self._open
        assert item is not None
        return {"item_id": item["id"], "output_index": self.items.index(item)}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    copy = dict(item)
    if "content" in copy:
        copy["content"] = [dict(part) for part in copy["content"]]
    return copy
