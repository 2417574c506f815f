"""gpt-oss reasoning (OpenAI's harmony format): the analysis channel is reasoning, the final and
commentary channels are the answer.

Rules (one scanner for streamed and whole outputs, see kvtide/tool_parsers/harmony.py):
- Text of `analysis` messages is reasoning (stripped at both ends, as every parser's reasoning).
- Text of `final` messages, and of commentary the model addresses to no one (a preamble to its
  calls), is content, without the headers around it.
- A message addressed to a tool stays in the content as harmony text, header included, so the
  `openai` tool-call parser finds the call; without that parser it is shown as written.
- Text outside any message is content, so a model that writes no harmony loses nothing.
"""

from __future__ import annotations

from kvtide.reasoning.base import ReasoningParser
from kvtide.tool_parsers.harmony import HarmonyScanner, is_tool_call, rewrite
from kvtide.tool_parsers.scan import StrippedStream

HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>")


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    start_tag = "<|channel|>analysis<|message|>"
    end_tag = "<|channel|>final<|message|>"
    """Where the answer starts: structured output applies from here on."""
    reasoning_without_start_tag = False
    markers = HARMONY_MARKERS

    def streaming(self) -> _GptOssStream:
        return _GptOssStream()

    def closed_by_prompt(self, prompt_text: str) -> bool:
        """A harmony prompt ends with `<|start|>assistant`: earlier turns' final messages in it
        close nothing of this one."""
        return False


class _GptOssStream:
    """One request's streaming state, with StreamingReasoningParser's feed/finish."""

    def __init__(self) -> None:
        self._scanner = HarmonyScanner()
        self._reasoning = StrippedStream(strip_trailing=True)
        self._open_call: object | None = None
        """The header of the tool-call message whose header has been written into the content."""

    def feed(self, delta_text: str) -> tuple[str | None, str | None]:
        return self._split(self._scanner.feed(delta_text))

    def finish(self) -> tuple[str | None, str | None]:
        return self._split(self._scanner.finish())

    def _split(self, pieces: list) -> tuple[str | None, str | None]:
        reasoning: list[str] = []
        content: list[str] = []
        for piece in pieces:
            header = piece.header
            if is_tool_call(header):
                content.append(rewrite(piece, opened=self._open_call is header))
                self._open_call = None if piece.end is not None else header
            elif header is not None and header.channel == "analysis":
                reasoning.append(self._reasoning.push(piece.text))
            else:
                content.append(piece.text)
        return "".join(reasoning) or None, "".join(content) or None
