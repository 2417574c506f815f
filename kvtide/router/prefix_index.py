"""An approximate prefix tree of the prompts each backend was sent, for cache-aware routing.

A prompt's text is cut into CHUNK_CHARS-character chunks and each chunk hashed together with the
hash of everything before it, so one hash stands for a whole prefix (the path from the root of a
prefix tree to a node):

    "You are a helpful assistant. Answer briefly: what is 2+2?"
     |---- chunk 0 ----|---- chunk 1 ----|---- chunk 2 ----|..   (trailing partial chunk: not hashed)
     h0 = H(0, c0)      h1 = H(h0, c1)    h2 = H(h1, c2)

A backend "has" a prefix of k chunks when its set holds h(k-1). The sets are LRU-bounded, as the
backends' own prefix caches evict old prefixes too; the index is approximate by design (the router
never sees the backends' evictions), which costs at worst a routing decision, never correctness.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

CHUNK_CHARS = 32
"""Characters per hashed chunk: small enough that a shared prefix is seen at fine grain, large
enough that a 100k-character prompt is ~3k hashes."""
MAX_ENTRIES_PER_BACKEND = 200_000
"""Prefix hashes remembered per backend (least recently used dropped first)."""


def chunk_hashes(text: str, chunk_chars: int = CHUNK_CHARS) -> list[bytes]:
    """The chained hash of each full chunk of `text` (see the module docstring)."""
    hashes = []
    previous = b""
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        previous = hashlib.blake2b(previous + text[start:start + chunk_chars].encode("utf-8", "surrogatepass"),
                                   digest_size=8).digest()
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """Per backend (any hashable key), the LRU-bounded set of prefix hashes it was sent."""

    def __init__(self, max_entries: int = MAX_ENTRIES_PER_BACKEND) -> None:
        self.max_entries = max_entries
        self._sets: dict[object, OrderedDict[bytes, None]] = {}

    def matched_chunks(self, key: object, hashes: list[bytes]) -> int:
        """How many leading chunks of a prompt `key` was sent."""
        seen = self._sets.get(key)
        if not seen:
            return 0
        matched = 0
        for h in hashes:
            if h not in seen:
                break
            matched += 1
        return matched

    def insert(self, key: object, hashes: list[bytes]) -> None:
        seen = self._sets.setdefault(key, OrderedDict())
        # Longest prefix first: the shorter ones, shared by more prompts, end up most recently used
        # and are dropped last.
        for h in reversed(hashes):
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_entries:
            seen.popitem(last=False)

    def size(self, key: object) -> int:
        return len(self._sets.get(key, ()))
