"""Stored responses (store: true): the response object for GET /v1/responses/{id} and the whole
conversation it ended (its input items, a previous response's before them, then its output), for
a later request's previous_response_id.

In memory and bounded: at most `max_entries` responses and about `max_bytes` of JSON together;
past either, the least recently used go first. A server restart forgets them all.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]
    conversation: list[dict[str, Any]]
    """Input items, oldest first, ending with this response's output items."""
    size: int


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(self, response_id: str, body: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep a response; False if it alone is larger than the whole store (then it is not kept)."""
        size = len(json.dumps(body, ensure_ascii=False)) + len(json.dumps(conversation, ensure_ascii=False))
        self.delete(response_id)
        if size > self.max_bytes:
            return False
        self._entries[response_id] = StoredResponse(body, conversation, size)
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True
