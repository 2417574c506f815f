"""One chat choice's generated text -> reasoning_content, content and tool calls.

    text ─▶ reasoning parser ─▶ reasoning_content
                   └─ answer ─▶ tool stream (tool_call_streams.py) ─▶ content, tool_calls

A stream feeds each new piece; the non-streamed response feeds the whole text once. Both run the
same stages in the same order, so a stream's deltas concatenate to the non-streamed message for
any split of the text. A parser that raises turns into plain text from there on: parsing never
fails a request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvtide.server.openai.chat_completions.tool_call_streams import merge_tool_calls

logger = logging.getLogger(__name__)


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: ChoiceDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls

    def wire(self) -> dict[str, Any]:
        """The fields of a streamed `delta` (those with something to say)."""
        delta: dict[str, Any] = {}
        if self.reasoning:
            delta["reasoning_content"] = self.reasoning
        if self.content:
            delta["content"] = self.content
        if self.tool_calls:
            delta["tool_calls"] = self.tool_calls
        return delta


class ChoiceAssembler:
    """Per choice (each of n has its own): `feed` each new piece of text, then `finish` once."""

    def __init__(self, reasoning_parser: Any | None, tool_stream: Any, include_reasoning: bool = True) -> None:
        self._reasoning = reasoning_parser.streaming() if reasoning_parser is not None else None
        self._tools = tool_stream
        self._include_reasoning = include_reasoning
        self._tools_broken = False
        self.num_tool_calls = 0

    def feed(self, text: str) -> ChoiceDelta:
        if not text:
            return ChoiceDelta()
        reasoning, answer = self._split(text, final=False)
        return self._delta(reasoning, *self._tool_step(answer, final=False))

    def finish(self) -> ChoiceDelta:
        reasoning, answer = self._split("", final=True)
        content, calls = self._tool_step(answer, final=False)
        tail_content, tail_calls = self._tool_step("", final=True)
        return self._delta(reasoning, content + tail_content, calls + tail_calls)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for an answer that ended in calls; a cut answer stays "length"."""
        return "tool_calls" if engine_reason == "stop" and self.num_tool_calls else engine_reason

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if self._reasoning is None:
            return "", text
        try:
            reasoning, answer = self._reasoning.finish() if final else self._reasoning.feed(text)
        except Exception:
            logger.exception("reasoning parser failed; the rest of the output is content")
            self._reasoning = None
            return "", text
        return reasoning or "", answer or ""

    def _tool_step(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        if self._tools_broken:
            return text, []
        try:
            return self._tools.finish() if final else self._tools.feed(text)
        except Exception:
            logger.exception("tool-call parser failed; the rest of the output is content")
            self._tools_broken = True
            return text, []

    def _delta(self, reasoning: str, content: str, calls: list[dict[str, Any]]) -> ChoiceDelta:
        self.num_tool_calls += sum(1 for call in calls if "id" in call)
        return ChoiceDelta(reasoning if self._include_reasoning else "", content, calls)


def assemble_message(assembler: ChoiceAssembler, text: str) -> dict[str, Any]:
    """The non-streamed message of a whole text: the stream's deltas, concatenated."""
    total = assembler.feed(text)
    total.add(assembler.finish())
    calls = merge_tool_calls(total.tool_calls)
    # Plain text keeps "" for an empty answer; beside reasoning or calls an empty answer is None.
    content = total.content or (None if calls or total.reasoning else "")
    return {"role": "assistant", "content": content, "reasoning_content": total.reasoning or None,
            "tool_calls": calls}
