"""Which web pages may drive this server: the checks that stand in for an API key against a browser.

A server without --api-key on a developer's machine is reachable by every page the developer opens.
A browser lets any page send three kinds of request to it without asking the server first, and the
guard middleware refuses each:

    what a hostile page can do                      refused by
    open a WebSocket to ws://127.0.0.1:8000          the Origin check: same-origin, loopback pages and
                                                     --allowed-origins only (403, before the handshake)
    POST text/plain, a form or a bare Blob           JSON endpoints take only application/json (415)
    rebind its own name to 127.0.0.1 (DNS rebinding) the Host check: bound to loopback, only loopback
                                                     names (--allowed-hosts otherwise) (400)

Clients that are not browsers send no Origin and the official openai client sends
`Content-Type: application/json`, so neither notices. This module holds the pure decisions; the
middleware applies them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvtide.net_auth import LOOPBACK_NAMES, is_loopback

ANY = "*"
"""In --allowed-origins or --allowed-hosts: allow every origin or host."""
DEFAULT_PORTS = {"http": 80, "ws": 80, "https": 443, "wss": 443}
JSON_MEDIA_TYPE = "application/json"


def split_host(host: str) -> tuple[str, int | None]:
    """A Host header value -> (lower-case host name without brackets, port or None).
    'localhost:8000' -> ('localhost', 8000); '[::1]:80' -> ('::1', 80); 'a.b' -> ('a.b', None).
    A malformed value ('127.0.0.1:80@evil', '[::1]x') comes back whole, so it matches no name."""
    host = host.strip().lower()
    if host.startswith("["):  # [v6]:port
        name, _, rest = host[1:].partition("]")
        if rest and not rest.startswith(":"):
            return host, None
        port = rest[1:]
    elif host.count(":") == 1:
        name, _, port = host.partition(":")
    else:  # no port, or a bare IPv6 literal
        name, port = host, ""
    if port and not port.isdigit():
        return host, None
    return name.rstrip("."), int(port) if port else None


def parse_list_flag(values: Iterable[str] | None) -> list[str]:
    """A list flag given as a JSON list (vLLM's `--allowed-origins '["a", "b"]'`), as repeated or
    several values, or as comma-separated values."""
    items: list[str] = []
    for value in values or ():
        value = value.strip()
        if value.startswith("["):
            parsed = json.loads(value)
            if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
                raise ValueError(f"expected a JSON list of strings, got {value!r}")
            items.extend(parsed)
        else:
            items.extend(v for v in value.split(","))
    return [item.strip() for item in items if item.strip()]


def normalize_origin(origin: str) -> str:
    """'HTTPS://Example.com:443/' -> 'https://example.com' (scheme://host[:port], the default port
    dropped), as browsers send it; ValueError if it is not one."""
    if origin == ANY or origin == "null":
        return origin
    parts = urlsplit(origin.strip())
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise ValueError(f"not an origin (scheme://host[:port]): {origin!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"not an origin (bad port): {origin!r}") from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    if port is None or port == DEFAULT_PORTS[parts.scheme]:
        return f"{parts.scheme}://{host}"
    return f"{parts.scheme}://{host}:{port}"


def default_allowed_hosts(bind_host: str) -> list[str] | None:
    """Bound to a loopback address, only loopback names may appear in Host (DNS rebinding points a
    hostile name at 127.0.0.1; it cannot make the browser send 'localhost'); bound to every
    interface or a specific one, the operator's names are unknown: any (None)."""
    return [*LOOPBACK_NAMES, "127.0.0.1", "::1"] if is_loopback(bind_host) else None


@dataclass
class BrowserPolicy:
    allowed_origins: list[str] = field(default_factory=list)
    """Origins allowed beyond same-origin and loopback pages (normalized; "*": any)."""
    allowed_hosts: list[str] | None = None
    """Host names (no port; "*.example.com" for subdomains) the Host header may carry; None: any.
    Loopback names are matched as loopback, so '127.0.0.1' admits 127.0.0.2 as well."""

    def __post_init__(self) -> None:
        self.allowed_origins = [normalize_origin(o) for o in self.allowed_origins]
        if self.allowed_hosts is not None:
            self.allowed_hosts = [h.strip().lower().strip("[]").rstrip(".") for h in self.allowed_hosts]
            if ANY in self.allowed_hosts:
                self.allowed_hosts = None

    def host_allowed(self, host: str | None) -> bool:
        """A request without a Host header comes from no browser (they always send one)."""
        if self.allowed_hosts is None or host is None:
            return True
        name, _ = split_host(host)
        for pattern in self.allowed_hosts:
            if pattern.startswith("*.") and name.endswith(pattern[1:]):
                return True
            if name == pattern or (is_loopback(pattern) and is_loopback(name)):
                return True
        return False

    def origin_allowed(self, origin: str | None, host: str | None, scheme: str) -> bool:
        """A WebSocket's Origin: absent (not a browser), the page's own origin (host and port equal
        to the Host header's), a loopback page, or one of allowed_origins."""
        if origin is None or ANY in self.allowed_origins:
            return True
        try:
            normalized = normalize_origin(origin)
        except ValueError:
            return False
        if normalized in self.allowed_origins:
            return True
        if normalized == "null":  # sandboxed frames and file:// pages: no origin to trust
            return False
        parts = urlsplit(normalized)
        assert parts.hostname is not None
        if is_loopback(parts.hostname):
            return True
        return host is not None and _same_origin(parts.scheme, parts.hostname, parts.port, host, scheme)


def _same_origin(origin_scheme: str, origin_name: str, origin_port: int | None, host: str, scheme: str) -> bool:
    name, port = split_host(host)
    if name != origin_name:
        return False
    origin_port = origin_port or DEFAULT_PORTS[origin_scheme]
    if port is not None:
        return port == origin_port
    # No port in Host: the default of the scheme the client used, or of the page's own scheme
    # (a TLS-terminating proxy in front turns https into ws).
    return origin_port in (DEFAULT_PORTS.get(scheme), DEFAULT_PORTS[origin_scheme])


def is_json_content_type(value: str) -> bool:
    """'application/json', with any parameters ('; charset=utf-8'), in any case."""
    return value.split(";", 1)[0].strip().lower() == JSON_MEDIA_TYPE
