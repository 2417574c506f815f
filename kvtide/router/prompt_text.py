"""The text of a request's prompt, as the cache-aware policy hashes it. It only has to be the same
for the same prompt and share a prefix when prompts do; it never reaches a backend.

    completions  "prompt": a string, token ids ([1, 2, 3] -> "1 2 3 "), or a batch of those (joined)
    chat         "messages" flattened in order: "<role>: <text parts>\\n"

answer_text() is what an answer adds to the next turn's text; AnswerCollector reads it off a relayed
response, so the cache-aware index records prompt + answer for the backend that computed both.
"""

from __future__ import annotations

import json
from typing import Any


def prompt_text(payload: dict[str, Any] | None) -> str:
    if not payload:
        return ""
    if "messages" in payload:
        return _messages_text(payload["messages"])
    return _prompt_text(payload.get("prompt"))


def answer_text(path: str, answer: str) -> str:
    """What a request's answer adds to its prompt text in the conversation's next request: a chat
    turn's next `messages` repeat it as an assistant message; a completion's next prompt continues
    the text."""
    if not answer:
        return ""
    return f"assistant: {answer}\n" if path.endswith("/chat/completions") else answer


class AnswerCollector:
    """The text of choice 0 of a relayed answer: a JSON body, or SSE chunks as they pass (a line
    may be split across chunks). Stops collecting past MAX_ANSWER_CHARS."""

    MAX_ANSWER_CHARS = 1 << 16

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.size = 0
        self._pending = b""

    def feed_json(self, body: bytes) -> None:
        try:
            self._take(json.loads(body), stream=False)
        except ValueError:
            pass

    def feed_sse(self, chunk: bytes) -> None:
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            if line.startswith(b"data: {"):
                try:
                    self._take(json.loads(line[len(b"data: "):]), stream=True)
                except ValueError:
                    continue

    def _take(self, payload: Any, stream: bool) -> None:
        if self.size > self.MAX_ANSWER_CHARS or not isinstance(payload, dict):
            return
        for choice in payload.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            part = choice.get("delta" if stream else "message") or {}
            text = choice.get("text") if "text" in choice else part.get("content") if isinstance(part, dict) else None
            if isinstance(text, str):
                self.parts.append(text)
                self.size += len(text)

    @property
    def text(self) -> str:
        return "".join(self.parts) if self.size <= self.MAX_ANSWER_CHARS else ""


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if all(isinstance(t, int) for t in prompt):
            return "".join(f"{t} " for t in prompt)
        return "\n".join(_prompt_text(p) for p in prompt)
    return "" if prompt is None else json.dumps(prompt, sort_keys=True)


def _messages_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") if isinstance(p, dict) and p.get("type") == "text"
                              else json.dumps(p, sort_keys=True) for p in content)
        elif not isinstance(content, str):
            content = "" if content is None else json.dumps(content, sort_keys=True)
        parts.append(f"{message.get('role', '')}: {content}\n")
    return "".join(parts)
