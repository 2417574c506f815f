"""Backend state the policies read and the proxy and health loop write: whether a backend may take
new requests, and how many the router has in flight on it. One event loop owns it all, so plain
attributes are enough (no locks)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class Backend:
    """One upstream server. `healthy` is False until its first /health answers 200, after a failed
    health check or connection, and while it drains (it answered 503)."""

    url: str
    healthy: bool = False
    in_flight: int = 0
    last_error: str | None = None

    def eject(self, reason: str) -> None:
        self.healthy = False
        self.last_error = reason

    def admit(self) -> None:
        self.healthy = True
        self.last_error = None


class BackendPool:
    """The backends one policy chooses among (all of them, or the prefill or decode pool).
    Backend objects are shared between pools, so health and load are counted once per URL."""

    def __init__(self, name: str, backends: list[Backend]) -> None:
        self.name = name
        self.backends = backends

    def __len__(self) -> int:
        return len(self.backends)

    def available(self, exclude: set[Backend] | frozenset[Backend] = frozenset()) -> list[Backend]:
        return [b for b in self.backends if b.healthy and b not in exclude]

    def any_healthy(self) -> bool:
        return any(b.healthy for b in self.backends)
