"""Ways to cut a text into stream chunks, for the streaming parsers' tests: 1-char chunks, every
single cut point, and seeded random chunk sizes."""

from __future__ import annotations

import random
from collections.abc import Iterator


def splits(text: str, max_chunk: int, num_random: int = 30) -> Iterator[tuple[str, list[str]]]:
    """(label, chunks) pairs; the chunks of each concatenate to `text`."""
    yield "1-char chunks", list(text)
    for cut in range(len(text) + 1):
        yield f"cut at {cut}", [text[:cut], text[cut:]]
    rng = random.Random(len(text))
    for _ in range(num_random):
        chunks, pos = [], 0
        while pos < len(text):
            size = rng.randint(1, max_chunk)
            chunks.append(text[pos:pos + size])
            pos += size
        yield f"random {chunks!r}", chunks


def cut_at(text: str, cuts: list[int]) -> list[str]:
    """`text` cut at the given positions (those past its end ignored)."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
