"""Chat roles through the model's own template, one message at a time.

A program appends a message in steps (its opening, then text and calls, then its closing), so it
needs the template's text around one message's content. That text is read off the template
itself: render the conversation so far, render it with one more message whose content is a
sentinel, and split the difference at the sentinel. For the demo template and `user`:

    history          "<s><|system|>You plan.\n"
    history + user   "<s><|system|>You plan.\n<|user|>@@SENTINEL@@\n"
    frame            ("<|user|>", "\n")

The first message's opening includes what the template puts before any message (BOS, a default
system prompt). Any template whose rendering of a conversation starts with its rendering of every
shorter one works; a template that rewrites earlier messages as the conversation grows is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable

SENTINEL = "KVTIDE_LANG_CONTENT_SENTINEL"


class ChatRenderer:
    """Role frames of one backend's chat template, cached per conversation shape."""

    def __init__(self, render: Callable[[list[dict[str, str]]], str]) -> None:
        self._render = render
        self._frames: dict[str, tuple[str, str]] = {}

    def frame(self, history: list[dict[str, str]], role: str) -> tuple[str, str]:
        """The template's text before and after the content of a `role` message that follows
        `history`."""
        key = json.dumps([history, role])
        if key not in self._frames:
            self._frames[key] = self._compute(history, role)
        return self._frames[key]

    def _compute(self, history: list[dict[str, str]], role: str) -> tuple[str, str]:
        try:
            base = self._render(history) if history else ""
            full = self._render([*history, {"role": role, "content": SENTINEL}])
        except ValueError:
            raise
        except Exception as e:  # a template's own refusal (e.g. roles out of order) is the program's error
            raise ValueError(f"the chat template cannot render a {role!r} message here: {e}") from e
        if not full.startswith(base) or full.count(SENTINEL) != 1:
            raise ValueError(f"the chat template does not render a {role!r} message as an addition to the "
                             "conversation before it")
        begin, end = full[len(base):].split(SENTINEL)
        return begin, end
