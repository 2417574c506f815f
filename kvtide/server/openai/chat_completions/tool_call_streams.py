"""Per choice: the answer's text, piece by piece -> content and OpenAI's tool-call deltas.

One class per tool_choice mode, all with `feed(text)` and `finish()` returning (content, tool-call
delta dicts). The non-streamed response feeds the whole text at once (or uses the parser's own
one-shot extraction, which its contract makes equal), so a stream's deltas concatenate to the
non-streamed message. A delta dict is what OpenAI streams:

    {"index": 0, "id": "call_...", "type": "function", "function": {"name": "f", "arguments": ""}}
    {"index": 0, "function": {"arguments": "{\\"city\\": "}}

Text that does not have the expected shape ends up in content: parsing never fails a request.
"""

from __future__ import annotations

from typing import Any

from kvtide.server.openai.chat_completions.json_text import JsonLexer, JsonToken
from kvtide.tool_parsers import make_tool_call_id

Deltas = tuple[str, list[dict[str, Any]]]


def call_header(index: int, name: str, call_id: str | None = None, arguments: str = "") -> dict[str, Any]:
    return {"index": index, "id": call_id or make_tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def arguments_delta(index: int, arguments: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": arguments}}


class PlainStream:
    """No tools (or tool_choice "none"): everything is content."""

    def feed(self, text: str) -> Deltas:
        return text, []

    def finish(self) -> Deltas:
        return "", []


class NamedToolStream:
    """tool_choice naming one function: the whole answer is that call's arguments (the engine
    constrains it to the function's parameters schema)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lexer = JsonLexer()
        self._started = False

    def feed(self, text: str) -> Deltas:
        return "", self._calls("".join(t.canonical for t in self._lexer.feed(text)))

    def finish(self) -> Deltas:
        return "", self._calls("".join(t.canonical for t in self._lexer.finish()), final=True)

    def _calls(self, arguments: str, final: bool = False) -> list[dict[str, Any]]:
        if not self._started:
            if not arguments and not final:
                return []
            self._started = True
            return [call_header(0, self.name, arguments=arguments)]
        return [arguments_delta(0, arguments)] if arguments else []


class RequiredToolsStream:
    """tool_choice "required": the answer is a JSON array of {"name": ..., "parameters": {...}}
    (vLLM's shape, which the engine enforces); each element becomes one call, its parameters the
    arguments. Until the first call's name is known the text is held back: if the array never
    takes shape it is all content."""

    def __init__(self) -> None:
        self._lexer = JsonLexer()
        self._held: list[str] = []
        self._num_calls = 0
        self._failed = False
        self._state = "start"
        # The element being read.
        self._key: str | None = None
        self._name: str | None = None
        self._arguments: list[str] = []
        self._depth = 0
        """Nesting inside the current value (parameters or a skipped key's value)."""

    def feed(self, text: str) -> Deltas:
        if self._failed:
            return text, []
        if not self._num_calls:
            self._held.append(text)
        return self._consume(self._lexer.feed(text))

    def finish(self) -> Deltas:
        if self._failed:
            return "", []
        content, calls = self._consume(self._lexer.finish())
        if not self._failed and not self._num_calls:
            return "".join(self._held), []
        return content, calls

    def _consume(self, tokens: list[JsonToken]) -> Deltas:
        calls: list[dict[str, Any]] = []
        for position, token in enumerate(tokens):
            if token.kind == "raw" and self._state == "parameters" and self._name is not None:
                calls.append(arguments_delta(self._num_calls - 1, token.raw))  # cut or broken arguments
                continue
            if token.kind == "raw" or not self._step(token, calls):
                self._failed = True
                rest = self._lexer.take_rest()
                if not self._num_calls:
                    return "".join(self._held), []
                return "".join(t.raw for t in tokens[position:]) + rest, calls
        return "", calls

    def _step(self, token: JsonToken, calls: list[dict[str, Any]]) -> bool:
        """Advance over one token; False if the text left the expected shape."""
        kind, state = token.kind, self._state
        if state == "start":
            self._state = "array"
            return kind == "["
        if state == "array":  # before an element, between elements, or at the end
            if kind == "{":
                self._state, self._key, self._name, self._arguments = "key", None, None, []
                return True
            if kind == "]":
                self._state = "done"
                return True
            return kind == ","
        if state == "key":
            if kind == "string":
                self._key, self._state = str(token.value), "colon"
                return True
            if kind == "}":
                self._state = "array"
                return self._name is not None
            return kind == ","
        if state == "colon":
            if kind != ":":
                return False
            self._state = {"name": "name", "parameters": "parameters"}.get(self._key or "", "skip")
            return True
        if state == "name":
            if kind != "string" or self._name is not None:
                return False
            self._name, self._state = str(token.value), "key"
            self._start_call(calls)
            return True
        if state in ("parameters", "skip"):
            return self._value_token(token, calls)
        return False  # text after the array

    def _value_token(self, token: JsonToken, calls: list[dict[str, Any]]) -> bool:
        if token.kind in ("{", "["):
            self._depth += 1
        elif token.kind in ("}", "]"):
            self._depth -= 1
            if self._depth < 0:
                return False
        elif token.kind in (",", ":") and self._depth == 0:
            return False
        if self._state == "parameters":
            self._arguments.append(token.canonical)
            if self._name is not None:
                calls.append(arguments_delta(self._num_calls - 1, token.canonical))
        if self._depth == 0:
            self._state = "key"
        return True

    def _start_call(self, calls: list[dict[str, Any]]) -> None:
        assert self._name is not None
        calls.append(call_header(self._num_calls, self._name, arguments="".join(self._arguments)))
        self._num_calls += 1
        self._held = []


class AutoToolStream:
    """tool_choice "auto": the server's tool parser (--tool-call-parser) finds the calls."""

    def __init__(self, parser: Any, parallel_tool_calls: bool = True) -> None:
        self._stream = parser.streaming()
        self._parallel = parallel_tool_calls
        self._ids: dict[int, str] = {}

    def feed(self, text: str) -> Deltas:
        return self._convert(self._stream.feed(text))

    def finish(self) -> Deltas:
        return self._convert(self._stream.finish())

    def _convert(self, message: Any) -> Deltas:
        if message is None:
            return "", []
        calls = []
        for delta in message.tool_calls:
            if delta.index > 0 and not self._parallel:
                continue
            if delta.index not in self._ids:
                self._ids[delta.index] = delta.id or make_tool_call_id()
                calls.append(call_header(delta.index, delta.name or "", self._ids[delta.index],
                                         delta.arguments or ""))
            elif delta.arguments:
                calls.append(arguments_delta(delta.index, delta.arguments))
        return message.content or "", calls


def merge_tool_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-call deltas -> the complete calls ({"id", "type", "function": {"name", "arguments"}})."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = calls.get(delta["index"])
        if call is None:
            calls[delta["index"]] = {"id": delta["id"], "type": "function",
                                     "function": {"name": delta["function"]["name"],
                                                  "arguments": delta["function"].get("arguments", "")}}
        else:
            call["function"]["arguments"] += delta["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]
