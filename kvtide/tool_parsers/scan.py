"""Text-scanning helpers the streaming tool parsers share: held-back tag prefixes, bracket matching,
whitespace stripping that streams.

Every helper decides from the text seen so far alone, never from where the chunks were cut, so a
stream parsed in pieces ends exactly where the whole text parsed at once does.
"""

from __future__ import annotations

import re

_SPACE = re.compile(r"\s*")


def skip_space(text: str, pos: int) -> int:
    """The first index at or after `pos` that is not whitespace (len(text) if none)."""
    return _SPACE.match(text, pos).end()  # type: ignore[union-attr]


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`.

    That suffix may still become the tag when the next chunk arrives, so a stream must hold it
    back: "see <tool_c" -> 7."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class BracketMatcher:
    """Finds where a bracketed value (a JSON object or array, a Python list) closes.

    Resumable: each scan() goes on from where the last one stopped, so a value streamed in many
    chunks is read once. Brackets inside strings do not count; whether the brackets pair up is left
    to the parser that reads the span, which rejects "[}" anyway.
    """

    def __init__(self, start: int, quotes: str = '"', brackets: str = "[]{}") -> None:
        self.start = start
        """Index of the opening bracket."""
        self._pos = start
        self._depth = 0
        self._quote: str | None = None
        self._openers = brackets[0::2]
        self._outside = re.compile("[" + re.escape(quotes + brackets) + "]")
        self._inside = {q: re.compile(r"[\\" + re.escape(q) + "]") for q in quotes}

    def scan(self, text: str) -> int | None:
        """Index just past the closing bracket, or None while the value is still open."""
        pos = self._pos
        while True:
            if self._quote is not None:
                match = self._inside[self._quote].search(text, pos)
                if match is None:
                    self._pos = len(text)
                    return None
                if match.group() == "\\":
                    if match.end() == len(text):  # the escaped character is in the next chunk
                        self._pos = match.start()
                        return None
                    pos = match.end() + 1
                    continue
                self._quote = None
                pos = match.end()
                continue
            match = self._outside.search(text, pos)
            if match is None:
                self._pos = len(text)
                return None
            char, pos = match.group(), match.end()
            if char in self._inside:
                self._quote = char
            elif char in self._openers:
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth <= 0:
                    self._pos = pos
                    return pos


class StrippedStream:
    """Streams a text with its leading and trailing whitespace removed, exactly as str.strip() would.

    Leading whitespace is dropped; trailing whitespace is held until more text follows it, so what
    has gone out is always a prefix of the final stripped text."""

    def __init__(self, strip_trailing: bool = True) -> None:
        self._strip_trailing = strip_trailing
        self._started = False
        self._held = ""

    def push(self, text: str) -> str:
        """The part of `text` (after what was held) that can go out now."""
        text = self._held + text
        self._held = ""
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        if self._strip_trailing:
            body = text.rstrip()
            self._held = text[len(body) :]
            return body
        return text
