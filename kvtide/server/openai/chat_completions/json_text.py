"""JSON text arriving in pieces, cut into tokens as soon as each is complete, each with its
canonical spelling (json.dumps's, ensure_ascii=False).

Tool-call arguments are sent canonical in one response and as fragments in a stream; writing
each token canonically the moment it is complete makes the fragments concatenate to exactly the
non-streamed arguments, however the text was split:

    '{"a" :1.50,"b":[true ]}' -> '{', '"a"', ': ', '1.5', ', ', '"b"', ': ', '[', 'true', ']', '}'

Text that stops being JSON comes back raw from there on (a model cut by max_tokens, or one that
was not constrained), so nothing a model writes is lost or raises.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

_PUNCTUATION = {"{": "{", "}": "}", "[": "[", "]": "]", ",": ", ", ":": ": "}
_LITERALS = ("true", "false", "null")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_WHITESPACE = " \t\n\r"


@dataclass(frozen=True)
class JsonToken:
    kind: str
    """One of "{", "}", "[", "]", ",", ":", "string", "number", "literal", or "raw" (not JSON)."""
    raw: str
    canonical: str
    value: object = None
    """The decoded string / number / literal (None for punctuation and raw text)."""


class JsonLexer:
    def __init__(self) -> None:
        self._buffer = ""
        self._failed = False

    def feed(self, text: str) -> list[JsonToken]:
        """The tokens completed by `text`; an incomplete one waits for the next piece."""
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[JsonToken]:
        """The tokens the end of the text completes (a trailing number); an incomplete token raw."""
        tokens = self._drain(final=True)
        if self._buffer:
            tokens.append(JsonToken("raw", self._buffer, self._buffer))
            self._buffer = ""
        return tokens

    def take_rest(self) -> str:
        """The text not yet returned as tokens, which this lexer then forgets."""
        rest, self._buffer = self._buffer, ""
        return rest

    def _drain(self, final: bool) -> list[JsonToken]:
        tokens: list[JsonToken] = []
        while self._buffer:
            if self._failed:
                tokens.append(JsonToken("raw", self._buffer, self._buffer))
                self._buffer = ""
                break
            self._buffer = self._buffer.lstrip(_WHITESPACE)
            if not self._buffer:
                break
            token, size = _next_token(self._buffer, final)
            if token is None and size == 0:
                break  # incomplete: wait for more text
            if token is None:
                self._failed = True
                continue
            tokens.append(token)
            self._buffer = self._buffer[size:]
        return tokens


def _next_token(text: str, final: bool) -> tuple[JsonToken | None, int]:
    """(token, its length) at the start of `text`; (None, 0) if it may still grow; (None, -1) if
    `text` does not start with a JSON token."""
    first = text[0]
    if first in _PUNCTUATION:
        return JsonToken(first, first, _PUNCTUATION[first]), 1
    if first == '"':
        return _string_token(text)
    if first == "-" or first.isdigit():
        end = 0
        while end < len(text) and text[end] in _NUMBER_CHARS:
            end += 1
        if end == len(text) and not final:
            return None, 0
        raw = text[:end]
        if not _NUMBER.fullmatch(raw):
            return None, -1
        value = json.loads(raw)
        canonical = json.dumps(value) if math.isfinite(value) else raw  # 1e999: json.dumps would write Infinity
        return JsonToken("number", raw, canonical, value), end
    for literal in _LITERALS:
        if text.startswith(literal):
            return JsonToken("literal", literal, literal, json.loads(literal)), len(literal)
        if literal.startswith(text):
            return None, 0
    return None, -1


def _string_token(text: str) -> tuple[JsonToken | None, int]:
    index = 1
    while True:
        index = text.find('"', index)
        if index < 0:
            return None, 0
        backslashes = 0
        while text[index - 1 - backslashes] == "\\":
            backslashes += 1
        if backslashes % 2 == 0:
            break
        index += 1
    raw = text[:index + 1]
    try:
        value = json.loads(raw)
    except ValueError:
        return None, -1
    canonical = json.dumps(value, ensure_ascii=False)
    try:
        canonical.encode("utf-8")
    except UnicodeEncodeError:  # an escaped lone surrogate: keep it escaped
        canonical = raw
    return JsonToken("string", raw, canonical, value), index + 1


def canonical_json(text: str) -> str:
    """`text` as the concatenated canonical tokens (json.dumps(json.loads(text)) for JSON text
    without duplicate keys; raw from the first place it is not JSON)."""
    lexer = JsonLexer()
    return "".join(t.canonical for t in lexer.feed(text) + lexer.finish())
