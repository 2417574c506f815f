"""The tool-call parser interface: the server turns a model's text into OpenAI tool calls with it.

Each format's parser is one streaming scanner. The non-streamed result is that scanner run over the
whole text, so a response is the same whether it was streamed or not, however the text was cut
into chunks. Text that turns out not to be a well-formed call is content, never an error.
"""

from __future__ import annotations

import json
import logging
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvtide.tool_parsers.scan import StrippedStream

logger = logging.getLogger(__name__)

_ID_ALPHABET = string.ascii_letters + string.digits


def make_tool_call_id() -> str:
    """An OpenAI-style id, "call_" and 24 alphanumerics: unique per call, without touching `random`'s
    seeded state."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class ToolCall:
    """One complete call. `arguments` is canonical JSON text of an object (json.dumps with
    ensure_ascii=False), so streamed and non-streamed calls agree and clients can json.loads it."""

    name: str
    arguments: str
    id: str = field(default_factory=make_tool_call_id)


@dataclass
class ExtractedToolCalls:
    """A whole output split in two: `content` is the text outside the calls, stripped of leading and
    trailing whitespace (None when nothing is left)."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass
class ToolCallDelta:
    """A piece of one call in a stream. The first piece of a call carries its id and name; the
    arguments text is the concatenation of all its pieces' `arguments`."""

    index: int
    """0-based position of the call in this choice."""
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class DeltaMessage:
    """What one chunk of streamed text adds to the response."""

    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


Event = str | ToolCall
"""What a scanner decides about a stretch of text: it is content (str), or it was one call."""


class StreamingToolParser:
    """One request's streaming state (make one per request with ToolParser.streaming()).

    A subclass implements _scan(): it appends the new text to what it holds and returns events for
    every stretch that is decided. Text that may still turn out to be part of a call is held, so
    content once sent is never taken back, and a call goes out whole once it is known to be well
    formed: one delta with id, name and the complete arguments.
    """

    def __init__(self) -> None:
        self._content = StrippedStream()
        self._num_calls = 0
        self._finished = False

    def feed(self, delta_text: str) -> DeltaMessage | None:
        """Take the next chunk; None when nothing can be sent yet."""
        if self._finished or not delta_text:
            return None
        return self._message(self._scan(delta_text, final=False))

    def finish(self) -> DeltaMessage | None:
        """End of stream: whatever was held is now decided and sent."""
        if self._finished:
            return None
        self._finished = True
        return self._message(self._scan("", final=True))

    def _scan(self, delta_text: str, final: bool) -> list[Event]:
        raise NotImplementedError

    def _message(self, events: list[Event]) -> DeltaMessage | None:
        content = self._content.push("".join(e for e in events if isinstance(e, str)))
        deltas = []
        for event in events:
            if isinstance(event, ToolCall):
                deltas.append(ToolCallDelta(self._num_calls, event.id, event.name, event.arguments))
                self._num_calls += 1
        if not content and not deltas:
            return None
        return DeltaMessage(content or None, deltas)


class ToolParser:
    """A model family's tool-call format. Parsers read text only; `tokenizer` (a Hugging Face
    tokenizer) is kept for formats that may need it and is never required.

    The server must detokenize without skipping special tokens for formats whose markers are
    special tokens ([TOOL_CALLS], <|python_tag|>), or the markers never reach the parser.
    """

    name: ClassVar[str]

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def streaming(self) -> StreamingToolParser:
        """Fresh per-request streaming state."""
        raise NotImplementedError

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        """The calls in a whole output, and the text around them as content. Never raises."""
        try:
            events = self.streaming()._scan(model_output, final=True)
        except Exception:  # a scanner bug must not fail the request: the text is still the answer
            logger.exception("%s tool parser failed; returning the output as content", self.name)
            return ExtractedToolCalls(model_output.strip() or None, [])
        content = "".join(e for e in events if isinstance(e, str)).strip()
        return ExtractedToolCalls(content or None, [e for e in events if isinstance(e, ToolCall)])


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def load_json(text: str) -> Any:
    """json.loads without NaN/Infinity, which json.dumps would write back as invalid JSON."""
    return json.loads(text, parse_constant=_reject_constant)


def canonical_arguments(arguments: dict[str, Any]) -> str:
    """The one text form of an arguments object; raises ValueError for non-finite floats."""
    return json.dumps(arguments, ensure_ascii=False, allow_nan=False)


def call_from_object(
    obj: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")
) -> ToolCall | None:
    """A call from a decoded {"name": ..., "arguments": {...}} object, or None if it is not one.

    The arguments key must be present and hold an object: plain JSON that merely has a "name"
    (an answer the user asked to be JSON) stays content."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    else:
        return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name, canonical_arguments(arguments))


def parse_call_json(
    text: str, argument_keys: tuple[str, ...] = ("arguments", "parameters")
) -> ToolCall | None:
    """A call from the JSON text of one call object, or None if the text is anything else."""
    try:
        return call_from_object(load_json(text), argument_keys)
    except Exception:  # ValueError, RecursionError on absurd nesting: either way, not a call
        return None


class WholeOutputStream(StreamingToolParser):
    """The stream of a format whose output is either all calls or all content (llama3_json,
    pythonic): text is held until the format is ruled out (then it streams as content) or the
    stream ends complete (then the calls go out). Subclasses read on in `_step` and say in
    `_complete` whether the state at the end is a finished set of calls."""

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._pos = 0
        self._state = "head"
        self._matcher = None
        self._calls: list[ToolCall] = []

    def _scan(self, delta_text: str, final: bool) -> list[Event]:
        if self._state == "content":
            return [delta_text]
        self._text += delta_text
        while self._step():
            pass
        if self._state == "content":
            text, self._text = self._text, ""
            return [text]
        if not final:
            return []
        if self._complete():
            return list(self._calls)
        self._state = "content"
        return [self._text]

    def _step(self) -> bool:
        """Read on from self._pos; False when decided or when the rest must wait for more text."""
        raise NotImplementedError

    def _complete(self) -> bool:
        raise NotImplementedError
