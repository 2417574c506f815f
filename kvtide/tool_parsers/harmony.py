"""OpenAI's harmony format (gpt-oss): an answer is a run of messages, each on a channel, some
addressed to a tool.

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

    <|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>

The chat template ends the prompt with `<|start|>assistant`, so the first header comes without it.
A header runs up to `<|message|>`; it names the channel (`<|channel|>NAME`) and, for a tool call,
the recipient (`to=functions.NAME`, before or after the channel). A body runs up to `<|end|>`,
`<|call|>` or `<|return|>` (the last two are stop tokens, so an answer's text usually just ends).

`HarmonyScanner` cuts a streamed text into those pieces, deciding each stretch from the text seen
so far alone (a marker cut between chunks is held), so the `openai_gptoss` reasoning parser and the
`openai` tool-call parser give the same result streamed or whole. Text outside any message (a model
that did not write harmony) is plain text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvtide.tool_parsers.base import (
    Event,
    StreamingToolParser,
    ToolCall,
    ToolParser,
    canonical_arguments,
    load_json,
)
from kvtide.tool_parsers.scan import partial_tag_len

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
TERMINATORS = ("<|end|>", "<|call|>", "<|return|>")
HEADER_OPENERS = (START, CHANNEL)
MAX_HEADER_CHARS = 512
"""A header whose `<|message|>` starts further than this from its opening marker is not one (a
harmony header is a role, a channel, a recipient and a content type): the marker is plain text."""

_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


@dataclass
class Header:
    """What a message's header says: its channel ("" when it names none) and its recipient."""

    channel: str
    recipient: str | None
    text: str
    """The header as written (from its opening marker to `<|message|>`, both included)."""

    @classmethod
    def parse(cls, text: str) -> Header:
        channel = _CHANNEL_NAME.search(text)
        recipient = _RECIPIENT.search(text)
        return cls(channel.group(1) if channel else "", recipient.group(1) if recipient else None, text)


@dataclass
class Piece:
    """A decided stretch of the answer: plain text outside messages (header None), part of a
    message's body, or the end of a message (`end` set: the terminator written, "" at the end of
    the text)."""

    text: str
    header: Header | None = None
    end: str | None = None


class HarmonyScanner:
    """One answer's streaming state: `feed` text, get the pieces decided so far; `finish` at the end."""

    def __init__(self) -> None:
        self._buffer = ""
        self._header: Header | None = None
        """The open message's header; None outside messages."""
        self._in_header = False

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while self._step(pieces, final=False):
            pass
        return pieces

    def finish(self) -> list[Piece]:
        pieces: list[Piece] = []
        while self._step(pieces, final=True):
            pass
        if self._header is not None:
            pieces.append(Piece("", self._header, end=""))
            self._header = None
        return pieces

    def _step(self, pieces: list[Piece], final: bool) -> bool:
        """Decide the next stretch of the buffer; False when the rest must wait for more text."""
        buffer = self._buffer
        if self._in_header:
            end = buffer.find(MESSAGE)
            if end < 0 and not final and len(buffer) < MAX_HEADER_CHARS + len(MESSAGE):
                return False  # `<|message|>` may still come within the bound
            self._in_header = False
            if end < 0 or end > MAX_HEADER_CHARS:  # not a header: its opening marker is plain text
                opener = next(m for m in HEADER_OPENERS if buffer.startswith(m))
                pieces.append(Piece(opener))
                self._buffer = buffer[len(opener) :]
                return True
            self._header = Header.parse(buffer[: end + len(MESSAGE)])
            self._buffer = buffer[end + len(MESSAGE) :]
            return True
        markers = TERMINATORS + (START,) if self._header is not None else HEADER_OPENERS
        found = [(i, m) for m in markers if (i := buffer.find(m)) >= 0]
        if not found:
            keep = 0 if final else max(partial_tag_len(buffer, m) for m in markers)
            if len(buffer) > keep:
                pieces.append(Piece(buffer[: len(buffer) - keep], self._header))
            self._buffer = buffer[len(buffer) - keep :]
            return False
        pos, marker = min(found)
        if pos:
            pieces.append(Piece(buffer[:pos], self._header))
        if self._header is not None:
            pieces.append(Piece("", self._header, end=marker if marker != START else ""))
            self._header = None
            if marker != START:
                self._buffer = buffer[pos + len(marker) :]
                return True
        self._in_header = True
        self._buffer = buffer[pos:]
        return True


def is_tool_call(header: Header | None) -> bool:
    """A message addressed to a function tool (built-in tools such as `browser.search` are not
    served: their messages are not calls)."""
    return header is not None and header.recipient is not None and header.recipient.startswith("functions.")


def rewrite(piece: Piece, opened: bool) -> str:
    """A tool-call message's piece written back as harmony text (its header first, when `opened`
    is False), so a tool-call parser further on still finds the call."""
    assert piece.header is not None
    text = piece.text if opened else piece.header.text + piece.text
    return text + (piece.end or "")


class OpenAIToolParser(ToolParser):
    """gpt-oss's function calls: each message addressed to `functions.NAME` is one call whose body is
    the JSON arguments; final and commentary text is content; analysis text (reasoning, which the
    `openai_gptoss` reasoning parser returns apart) is not part of the answer."""

    name = "openai"

    def streaming(self) -> StreamingToolParser:
        return _OpenAIToolStream()


class _OpenAIToolStream(StreamingToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._scanner = HarmonyScanner()
        self._body = ""
        """The open tool-call message's arguments so far."""

    def _scan(self, delta_text: str, final: bool) -> list[Event]:
        pieces = self._scanner.feed(delta_text)
        if final:
            pieces += self._scanner.finish()
        events: list[Event] = []
        for piece in pieces:
            header = piece.header
            if is_tool_call(header):
                self._body += piece.text
                if piece.end is not None:
                    events.append(_call(header, self._body) or rewrite(Piece(self._body, header, piece.end), False))
                    self._body = ""
            elif header is None or header.channel != "analysis":
                events.append(piece.text)
        return events


def _call(header: Header, body: str) -> ToolCall | None:
    """The call a message makes, or None when its body is not a JSON object."""
    try:
        arguments = load_json(body)
    except Exception:  # ValueError, RecursionError: not a call, the text stays content
        return None
    if not isinstance(arguments, dict):
        return None
    assert header.recipient is not None
    return ToolCall(header.recipient.removeprefix("functions."), canonical_arguments(arguments))
