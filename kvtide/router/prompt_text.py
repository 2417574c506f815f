"""The text of a request's prompt, as the cache-aware policy hashes it. It only has to be the same
for the same prompt and share a prefix when prompts do; it never reaches a backend.

    completions  "prompt": a string, token ids ([1, 2, 3] -> "1 2 3 "), or a batch of those (joined)
    chat         "messages" flattened in order: "<role>: <text parts>\\n"
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
