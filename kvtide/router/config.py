"""RouterSettings: everything the command line decides, checked before any socket opens, so a bad
flag fails in a second with exit status 2 rather than after the router started."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

POLICIES = ("cache_aware", "least_load", "round_robin")

DEFAULT_HEALTH_CHECK_INTERVAL_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 5.0
"""A backend that takes longer than this to answer GET /health is ejected."""
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_CACHE_THRESHOLD = 0.5
DEFAULT_BALANCE_THRESHOLD = 4
MAX_REQUEST_BODY = 32 * 1024 * 1024
"""Bytes the router buffers per request body (it reads the prompt to route it); larger gets 413 as
soon as Content-Length says so or, for a chunked body, as soon as that many bytes have arrived."""


@dataclass
class RouterSettings:
    """The router's configuration. `backends` serve whole requests; `prefill` and `decode` (both or
    neither) turn on prefill/decode disaggregation, where `backends` join the decode pool."""

    backends: list[str] = field(default_factory=list)
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    policy: str = "cache_aware"
    health_check_interval: float = DEFAULT_HEALTH_CHECK_INTERVAL_S
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S
    cache_threshold: float = DEFAULT_CACHE_THRESHOLD
    balance_threshold: int = DEFAULT_BALANCE_THRESHOLD
    api_key: str | None = None
    api_keys_file: str | None = None
    backend_api_key: str | None = None

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)

    @property
    def decode_pool(self) -> list[str]:
        return _unique(self.decode + self.backends)

    @property
    def all_backends(self) -> list[str]:
        return _unique(self.backends + self.prefill + self.decode)

    def check(self) -> None:
        """ValueError with a message naming the flag, for anything the router cannot run with."""
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("--prefill and --decode go together: give both pools or neither")
        if not self.backends and not self.prefill:
            raise ValueError("give at least one backend: --backends URL[,URL...] (or --prefill and --decode)")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        if self.health_check_interval <= 0:
            raise ValueError("--health-check-interval must be > 0 seconds")
        if self.request_timeout <= 0:
            raise ValueError("--request-timeout must be > 0 seconds")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("--cache-threshold must be between 0 and 1")
        if self.balance_threshold < 0:
            raise ValueError("--balance-threshold must be >= 0")


def parse_backend_list(text: str, flag: str) -> list[str]:
    """'http://a:8000, http://b:8000/' -> ['http://a:8000', 'http://b:8000'] (ValueError naming
    `flag` for anything but http(s)://host[:port] with an optional path prefix)."""
    urls = []
    for item in text.split(","):
        url = item.strip().rstrip("/")
        if not url:
            continue
        try:
            parts = urlsplit(url)
            port = parts.port  # raises ValueError on a port that is not a number in range
        except ValueError as e:
            raise ValueError(f"{flag}: malformed URL {item.strip()!r} ({e})") from e
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"{flag}: malformed URL {item.strip()!r}: expected http(s)://HOST[:PORT]")
        del port
        urls.append(url)
    if not urls:
        raise ValueError(f"{flag}: no URL given")
    return _unique(urls)


def _unique(urls: list[str]) -> list[str]:
    return list(dict.fromkeys(urls))
