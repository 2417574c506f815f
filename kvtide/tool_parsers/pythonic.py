"""Pythonic tool calls (Llama 3.2, Llama 4): the whole output is a Python list of calls.

    [get_weather(city="San Francisco", unit="celsius"), get_time(timezone="PST")]
    <|python_start|>[get_weather(city="Paris")]<|python_end|>

Rules:
- After stripping whitespace and an optional <|python_start|> ... <|python_end|> wrapper, the
  output must be one non-empty list of calls, read with `ast` (never evaluated): plain function
  names, keyword arguments only, and literal values (str, int, float, bool, None, lists, tuples,
  dicts with string keys). Anything else anywhere makes the whole output content, verbatim.
- The JSON spellings true, false and null are read as True, False and None: models trained on
  JSON write them, and they cannot mean anything else in a literal.

The calls go out only at finish(), since text after the list would make it content; text that
cannot be such a list (it does not start with "[", or the list does not parse) streams at once.
"""

from __future__ import annotations

import ast
from typing import Any

from kvtide.tool_parsers.base import (
    StreamingToolParser,
    ToolCall,
    ToolParser,
    WholeOutputStream,
    canonical_arguments,
)
from kvtide.tool_parsers.scan import BracketMatcher, skip_space

START_TAG = "<|python_start|>"
END_TAG = "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def streaming(self) -> StreamingToolParser:
        return _PythonicStream()


def _literal(node: ast.expr) -> Any:
    """The value of a literal node; ValueError for anything that would need evaluating."""
    if isinstance(node, ast.Constant) and (node.value is None or type(node.value) in (str, int, float, bool)):
        return node.value
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, (ast.USub, ast.UAdd))
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) in (int, float)
    ):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(element) for element in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(key) if key is not None else None for key in node.keys]
        if not all(isinstance(key, str) for key in keys):
            raise ValueError("dict keys must be strings")
        return {key: _literal(value) for key, value in zip(keys, node.values, strict=True)}
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")


def parse_call_list(source: str) -> list[ToolCall] | None:
    """The calls in the text of a Python list of calls, or None if it is anything else."""
    try:
        tree = ast.parse(source, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            if any(keyword.arg is None for keyword in node.keywords):  # **kwargs
                return None
            arguments = {keyword.arg: _literal(keyword.value) for keyword in node.keywords}
            calls.append(ToolCall(node.func.id, canonical_arguments(arguments)))
        return calls
    except Exception:  # SyntaxError, ValueError, RecursionError on absurd nesting: not calls
        return None


class _PythonicStream(WholeOutputStream):
    def __init__(self) -> None:
        super().__init__()
        # states: head -> list -> tail; or content, for good.
        self._start_seen = False
        self._end_seen = False
        self._matcher: BracketMatcher | None = None

    def _complete(self) -> bool:
        return self._state == "tail" and skip_space(self._text, self._pos) == len(self._text)

    def _step(self) -> bool:
        text = self._text
        if self._state == "list":
            assert self._matcher is not None
            end = self._matcher.scan(text)
            if end is None:
                return False
            calls = parse_call_list(text[self._matcher.start : end])
            if calls is None:
                self._state = "content"
                return False
            self._calls, self._pos, self._state = calls, end, "tail"
            return True
        pos = skip_space(text, self._pos)
        if pos == len(text):
            return False
        rest = text[pos:]
        tag, seen = (START_TAG, self._start_seen) if self._state == "head" else (END_TAG, self._end_seen)
        if not seen:
            if rest.startswith(tag):
                self._pos = pos + len(tag)
                self._start_seen = self._start_seen or self._state == "head"
                self._end_seen = self._end_seen or self._state == "tail"
                return True
            if tag.startswith(rest):
                return False
        if self._state == "head" and rest[0] == "[":
            self._matcher = BracketMatcher(pos, quotes="'\"", brackets="[](){}")
            self._state = "list"
            return True
        self._state = "content"
        return False
