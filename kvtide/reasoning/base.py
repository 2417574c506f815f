"""The reasoning-parser interface: split a thinking model's text into reasoning_content and content.

Each parser is one streaming scanner; the non-streamed result is that scanner run over the whole
text, so both agree however the text was cut into chunks. Shared rules:
- Whitespace next to the tags belongs to neither part: reasoning is stripped at both ends, and
  content that follows the end tag loses its leading whitespace. An empty part is None.
- Only the first end tag counts; a later one is ordinary content.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from kvtide.tool_parsers.scan import StrippedStream, partial_tag_len

logger = logging.getLogger(__name__)


class StreamingReasoningParser:
    """One request's streaming state (make one per request with ReasoningParser.streaming()).

    Text that may be the start of a tag ("</th") is held until the next chunk decides it."""

    def __init__(self, start_tag: str, end_tag: str, reasoning_without_start_tag: bool) -> None:
        self._start_tag = start_tag
        self._end_tag = end_tag
        self._reasoning_without_start_tag = reasoning_without_start_tag
        self._buffer = ""
        self._state = "start"
        """start -> reasoning -> content_after_end; or start -> content (no reasoning at all)."""
        self._reasoning = StrippedStream(strip_trailing=True)
        self._content_after_end = StrippedStream(strip_trailing=False)
        self._finished = False

    def feed(self, delta_text: str) -> tuple[str | None, str | None]:
        """(reasoning delta, content delta) for the next chunk; None for a part with nothing to send."""
        if self._finished:
            return None, None
        self._buffer += delta_text
        return self._scan(final=False)

    def finish(self) -> tuple[str | None, str | None]:
        """End of stream: whatever was held is decided and sent."""
        if self._finished:
            return None, None
        self._finished = True
        return self._scan(final=True)

    def _scan(self, final: bool) -> tuple[str | None, str | None]:
        reasoning: list[str] = []
        content: list[str] = []
        while self._step(reasoning, content, final):
            pass
        return "".join(reasoning) or None, "".join(content) or None

    def _step(self, reasoning: list[str], content: list[str], final: bool) -> bool:
        """Decide the next stretch of the buffer; False when the rest must wait for more text."""
        buffer = self._buffer
        if self._state == "start":
            opening = buffer.lstrip()
            if opening.startswith(self._start_tag):
                self._buffer, self._state = opening[len(self._start_tag) :], "reasoning"
                return True
            if not final and self._start_tag.startswith(opening):
                return False
            self._state = "reasoning" if self._reasoning_without_start_tag else "content"
            return True
        if self._state == "reasoning":
            end = buffer.find(self._end_tag)
            if end >= 0:
                reasoning.append(self._reasoning.push(buffer[:end]))
                self._buffer, self._state = buffer[end + len(self._end_tag) :], "content_after_end"
                return True
            keep = 0 if final else partial_tag_len(buffer, self._end_tag)
            reasoning.append(self._reasoning.push(buffer[: len(buffer) - keep]))
            self._buffer = buffer[len(buffer) - keep :]
            return False
        if self._state == "content_after_end":
            content.append(self._content_after_end.push(buffer))
        else:
            content.append(buffer)
        self._buffer = ""
        return False


class ReasoningParser:
    """A thinking model family's convention for where reasoning ends. Parsers read text only;
    `tokenizer` (a Hugging Face tokenizer) is kept for parsers that may need it, never required.

    The server must detokenize without skipping special tokens if the model's tags are special
    tokens, or the tags never reach the parser."""

    name: ClassVar[str]
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    reasoning_without_start_tag: ClassVar[bool]
    """What an output not opening with start_tag is: reasoning (the prompt opened the tag) or content."""
    markers: ClassVar[tuple[str, ...] | None] = None
    """The strings the parser reads, when not just its two tags: if any is a special token, the
    server keeps special tokens in the text."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def streaming(self) -> StreamingReasoningParser:
        """Fresh per-request streaming state."""
        return StreamingReasoningParser(self.start_tag, self.end_tag, self.reasoning_without_start_tag)

    def closed_by_prompt(self, prompt_text: str) -> bool:
        """The prompt already ended the reasoning section (Qwen3 with thinking off): the whole
        output is the answer."""
        end = prompt_text.rfind(self.end_tag)
        return end >= 0 and end > prompt_text.rfind(self.start_tag)

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output. Never raises."""
        try:
            stream = self.streaming()
            reasoning, content = stream.feed(model_output)
            reasoning_tail, content_tail = stream.finish()
        except Exception:  # a parser bug must not fail the request: the text is still the answer
            logger.exception("%s reasoning parser failed; returning the output as content", self.name)
            return None, model_output or None
        return _join(reasoning, reasoning_tail), _join(content, content_tail)


def _join(head: str | None, tail: str | None) -> str | None:
    return ((head or "") + (tail or "")) or None
