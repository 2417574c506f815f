"""Per-key quotas: which API keys may call, and how much (`kvtide serve --api-keys-file`; any ASGI
app may install QuotaMiddleware, e.g. a router in front of several servers).

The file is JSON:

    {"keys": [
      {"key": "sk-a", "name": "team-a", "requests_per_minute": 60, "tokens_per_minute": 100000,
       "max_concurrent": 4},
      {"key": "sk-b"}
    ]}

Each limit is optional (absent or null: unlimited) and otherwise a positive integer. `name` labels
the key's metrics and log lines (default: "key-" and the first 8 hex digits of the key's sha256);
the key itself is never logged nor used as a label. A malformed file (not JSON, unknown fields,
wrong types, limits <= 0, duplicate keys or names, no keys) is a ValueError naming the entry by
its index and name, never by its key.

QuotaMiddleware, for each HTTP request or WebSocket whose path is not exempt, before the app
sees it (a refused request changes no engine state):

    key (Authorization: Bearer K | x-api-key: K)
      ─▶ 401 unknown key ─▶ 429 requests/min ─▶ 429 tokens/min ─▶ 429 concurrent ─▶ app
                                                  tokens charged as the response ends ◀─┘

Windows slide over the last 60 s. A request is refused for tokens when its key's window already
holds the limit: what a request costs is known only after it ran, so the last one admitted may
end over the limit. A 429 carries `Retry-After`: the seconds until the window has room again (1
for the concurrency limit). The errors are OpenAI's error object (code "rate_limit_exceeded" or
"invalid_api_key"). A refused WebSocket is accepted, sent that error as one text message (with
"retry_after" in it) and closed: 1008 for the key, 1013 (try again later) for a limit.

Tokens charged (prompt + completion), from the engine's own counts where the app reports them:
the middleware puts a UsageCharge in the scope (CHARGE_SCOPE_KEY) and kvtide's serving code calls
`charge_tokens` with the prompt's tokens when it queues the request and `charged_outputs` charges
each output's new tokens as the engine yields them, streamed or not, over HTTP or a WebSocket. A
long prompt is therefore charged before its first token comes back, and the next request of an
exhausted key is refused even while this one still streams.

An app that reports nothing (e.g. the router, which only relays responses) is charged from what
it sends, without delaying it:
- an `application/json` response: its `usage` object (a copy of the body is kept, up to 16 MiB);
- a `text/event-stream` response or WebSocket text messages: the last `usage` object among the
  `data: {...}` events; a stream without one (no stream_options.include_usage) is charged one
  token per choice delta that carries content, an approximation that misses the prompt's tokens
  and undercounts chunks holding several tokens.

Metrics (registered in the given registry, else prometheus_client's default): counter
kvtide:quota_requests_total{key_name, outcome} with outcome admitted | rejected_requests |
rejected_tokens | rejected_concurrency | unauthorized (key_name "unknown"), counter
kvtide:quota_tokens_total{key_name} and gauge kvtide:quota_inflight{key_name}.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from kvtide.server.asgi import (
    ADMIN_SCOPE_KEY,
    WS_CLOSE_POLICY,
    WS_CLOSE_TRY_AGAIN_LATER,
    Message,
    Receive,
    Scope,
    Send,
    api_key_from_headers,
    invalid_api_key,
    reject_websocket,
    send_error,
)
from kvtide.server.errors import OpenAIError

logger = logging.getLogger(__name__)

WINDOW_S = 60.0
"""The sliding window of requests_per_minute and tokens_per_minute."""
UNKNOWN_KEY_NAME = "unknown"
"""key_name of requests refused with 401."""
MAX_JSON_COPY_BYTES = 16 * 1024 * 1024
"""A JSON response larger than this is not parsed for usage (charged 0 tokens)."""
CHARGE_SCOPE_KEY = "kvtide.quota_charge"
"""The scope key under which QuotaMiddleware hands the app its request's UsageCharge."""
LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")
_FIELDS = ("key", "name", *LIMIT_FIELDS)


@dataclass(frozen=True)
class ApiKey:
    """One key of the file and its limits (None: unlimited)."""

    key: str = field(repr=False)
    name: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None


class ApiKeys:
    """The keys QuotaMiddleware admits. `lookup` compares in constant time per key and always
    against every key, so timing reveals neither a prefix nor which entry matched."""

    def __init__(self, entries: Sequence[ApiKey]) -> None:
        if not entries:
            raise ValueError("no API keys: 'keys' must list at least one")
        _check_unique(entries)
        self.entries = tuple(entries)
        self._encoded = [entry.key.encode() for entry in self.entries]

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[ApiKey]:
        return iter(self.entries)

    @property
    def names(self) -> list[str]:
        return [entry.name for entry in self.entries]

    def lookup(self, token: bytes | str) -> ApiKey | None:
        """The entry whose key is `token`, or None (also for an empty token)."""
        if isinstance(token, str):
            token = token.encode()
        found = None
        for entry, key in zip(self.entries, self._encoded, strict=True):
            if hmac.compare_digest(token, key) and token:
                found = entry
        return found

    def with_key(self, key: str, name: str) -> ApiKeys:
        """These keys and one more without limits (kvtide serve adds --api-key's key this way)."""
        return ApiKeys([*self.entries, ApiKey(key=key, name=name)])


def load_api_keys(path: str) -> ApiKeys:
    """Read and validate an API keys file (format: the module docstring); ValueError if malformed."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"API keys file {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        # e.msg and the position only: the document (which holds keys) stays out of the message.
        raise ValueError(f"API keys file {path}: not valid JSON ({e.msg} at line {e.lineno}, "
                         f"column {e.colno})") from None
    try:
        return parse_api_keys(data)
    except ValueError as e:
        raise ValueError(f"API keys file {path}: {e}") from None


def parse_api_keys(data: Any) -> ApiKeys:
    """{"keys": [...]} (already parsed JSON) -> ApiKeys; ValueError if malformed."""
    if not isinstance(data, dict):
        raise ValueError('the top level must be an object: {"keys": [...]}')
    unknown = sorted(set(data) - {"keys"})
    if unknown:
        raise ValueError(f"unknown top-level field(s) {', '.join(map(repr, unknown))} (expected only 'keys')")
    keys = data.get("keys")
    if not isinstance(keys, list):
        raise ValueError(f"'keys' must be a list of objects, not {_type_name(keys)}")
    if not keys:
        raise ValueError("'keys' is empty: list at least one key")
    return ApiKeys([_parse_entry(i, item) for i, item in enumerate(keys)])


def _parse_entry(index: int, item: Any) -> ApiKey:
    where = f"keys[{index}]"
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be an object, not {_type_name(item)}")
    name = item.get("name")
    if name is not None:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where}: 'name' must be a non-empty string")
        where = f"{where} ({name!r})"
    unknown = sorted(set(item) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(_FIELDS)})")
    key = item.get("key")
    if not isinstance(key, str) or not key:
        raise ValueError(f"{where}: 'key' must be a non-empty string")
    if not (key.isascii() and key.isprintable()) or any(ch.isspace() for ch in key):
        raise ValueError(f"{where}: 'key' must be printable ASCII without spaces (it travels in a header)")
    limits = {}
    for limit in LIMIT_FIELDS:
        value = item.get(limit)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{where}: '{limit}' must be a positive integer or null (unlimited), "
                             f"not {value!r}")
        limits[limit] = value
    return ApiKey(key=key, name=name if name is not None else default_key_name(key), **limits)


def default_key_name(key: str) -> str:
    """A stable label for a key without a name, from which the key cannot be recovered."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def _check_unique(entries: Sequence[ApiKey]) -> None:
    seen_keys: dict[str, int] = {}
    seen_names: dict[str, int] = {}
    for i, entry in enumerate(entries):
        if entry.key in seen_keys:
            raise ValueError(f"keys[{seen_keys[entry.key]}] and keys[{i}] have the same key")
        if entry.name in seen_names:
            raise ValueError(f"keys[{seen_names[entry.name]}] and keys[{i}] have the same name {entry.name!r} "
                             f"(names label the metrics: make them unique)")
        seen_keys[entry.key] = i
        seen_names[entry.name] = i


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# ---- accounting ------------------------------------------------------------------------------------
@dataclass
class Refusal:
    outcome: str
    """The metrics outcome: rejected_requests | rejected_tokens | rejected_concurrency."""
    message: str
    retry_after_s: int


@dataclass
class _KeyUsage:
    requests: deque[float] = field(default_factory=deque)
    """Admission times within the window."""
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    """(time charged, tokens) within the window."""
    num_tokens: int = 0
    inflight: int = 0

    def prune(self, now: float) -> None:
        while self.requests and self.requests[0] <= now - WINDOW_S:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.num_tokens -= self.tokens.popleft()[1]


class QuotaTracker:
    """Sliding-window counts per key name (single-threaded: one event loop)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._usage: dict[str, _KeyUsage] = {}

    def _get(self, entry: ApiKey) -> _KeyUsage:
        usage = self._usage.get(entry.name)
        if usage is None:
            usage = self._usage[entry.name] = _KeyUsage()
        usage.prune(self.clock())
        return usage

    def admit(self, entry: ApiKey) -> Refusal | None:
        """Admit a request of `entry` (counted, in flight until `release`) or say why not."""
        now = self.clock()
        usage = self._get(entry)
        rpm, tpm, concurrent = entry.requests_per_minute, entry.tokens_per_minute, entry.max_concurrent
        if rpm is not None and len(usage.requests) >= rpm:
            return Refusal("rejected_requests", f"Rate limit reached for key {entry.name!r}: {rpm} requests "
                           f"per minute", _whole_seconds(usage.requests[0] + WINDOW_S - now))
        if tpm is not None and usage.num_tokens >= tpm:
            return Refusal("rejected_tokens", f"Rate limit reached for key {entry.name!r}: {tpm} tokens per "
                           f"minute (used {usage.num_tokens})", _whole_seconds(self._tokens_free_at(usage, tpm) - now))
        if concurrent is not None and usage.inflight >= concurrent:
            return Refusal("rejected_concurrency", f"Rate limit reached for key {entry.name!r}: {concurrent} "
                           f"concurrent request(s)", 1)
        usage.requests.append(now)
        usage.inflight += 1
        return None

    def release(self, entry: ApiKey) -> None:
        self._usage[entry.name].inflight -= 1

    def charge(self, entry: ApiKey, tokens: int) -> None:
        if tokens > 0:
            usage = self._get(entry)
            usage.tokens.append((self.clock(), tokens))
            usage.num_tokens += tokens

    def tokens_in_window(self, entry: ApiKey) -> int:
        return self._get(entry).num_tokens

    @staticmethod
    def _tokens_free_at(usage: _KeyUsage, limit: int) -> float:
        """When enough charges leave the window for the total to drop below `limit`."""
        excess = usage.num_tokens - limit
        freed = 0
        for charged_at, tokens in usage.tokens:
            freed += tokens
            if freed > excess:
                return charged_at + WINDOW_S
        return usage.tokens[-1][0] + WINDOW_S  # pragma: no cover (num_tokens is their sum)


def _whole_seconds(seconds: float) -> int:
    return max(1, math.ceil(seconds))


class TokenCounter:
    """Tokens a response used, read from the ASGI messages the app sends (see the module docstring)."""

    def __init__(self) -> None:
        self.kind: str | None = None
        """"json", "sse" or None (neither: nothing to count) for HTTP; "sse" for a WebSocket."""
        self._json = bytearray()
        self._json_too_big = False
        self._sse_buffer = b""
        self._usage: dict[str, Any] | None = None
        self._content_deltas = 0

    def observe(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = {k.lower(): v for k, v in message.get("headers", [])}
            content_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            self.kind = {b"application/json": "json", b"text/event-stream": "sse"}.get(content_type)
        elif kind == "http.response.body":
            body = message.get("body", b"")
            if self.kind == "json" and not self._json_too_big:
                self._json += body
                if len(self._json) > MAX_JSON_COPY_BYTES:
                    self._json_too_big = True
                    self._json.clear()
            elif self.kind == "sse":
                self._feed_sse(body)
        elif kind == "websocket.send":
            text = message.get("text")
            if text is not None:
                self._payload(text)

    def _feed_sse(self, data: bytes) -> None:
        self._sse_buffer = (self._sse_buffer + data).replace(b"\r\n", b"\n")
        *events, self._sse_buffer = self._sse_buffer.split(b"\n\n")
        for event in events:
            lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                self._payload(b"\n".join(lines).decode("utf-8", errors="replace"))

    def _payload(self, text: str) -> None:
        if text == "[DONE]" or not text.startswith("{"):
            return
        try:
            chunk = json.loads(text)
        except ValueError:
            return
        if not isinstance(chunk, dict):
            return
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        choices = chunk.get("choices")
        if isinstance(choices, list):
            self._content_deltas += sum(1 for choice in choices if _carries_content(choice))

    def total(self) -> int:
        if self.kind == "json" and self._json:
            try:
                body = json.loads(bytes(self._json))
            except ValueError:
                body = None
            usage = body.get("usage") if isinstance(body, dict) else None
            return _usage_tokens(usage) if isinstance(usage, dict) else 0
        if self._usage is not None:
            return _usage_tokens(self._usage)
        return self._content_deltas


def _carries_content(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and any(delta.get(k) for k in ("content", "reasoning_content", "tool_calls"))


def _usage_tokens(usage: dict[str, Any]) -> int:
    total = 0
    for name in ("prompt_tokens", "completion_tokens"):
        value = usage.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            total += value
    return total


# ---- charges reported by the app -------------------------------------------------------------------
class UsageCharge:
    """Charges one admitted request's tokens to its key as the app reports them (the engine's
    counts); `reported` tells the middleware not to count the response as well."""

    def __init__(self, charge: Callable[[int], None]) -> None:
        self._charge = charge
        self.reported = False

    def __call__(self, tokens: int) -> None:
        self.reported = True
        if tokens > 0:
            self._charge(tokens)


def _charge_of(request: Any) -> UsageCharge | None:
    scope = getattr(request, "scope", request)
    return scope.get(CHARGE_SCOPE_KEY) if isinstance(scope, dict) else None


def charge_tokens(request: Any, tokens: int) -> None:
    """Charge `tokens` to the key of `request` (a Starlette Request or an ASGI scope); nothing
    without quotas."""
    charge = _charge_of(request)
    if charge is not None:
        charge(tokens)


def charged_outputs(request: Any, outputs: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[tuple[int, Any]]:
    """`outputs` ((index, RequestOutput) pairs, as merge_streams yields them), each output's new
    completion tokens charged to the key of `request` as it passes; `outputs` itself without quotas."""
    charge = _charge_of(request)
    if charge is None:
        return outputs
    return _charging(charge, outputs)


async def _charging(charge: UsageCharge, outputs: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[tuple[int, Any]]:
    try:
        async for index, output in outputs:
            charge(sum(len(completion.token_ids) for completion in output.outputs))
            yield index, output
    finally:
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            await aclose()  # leaving early closes the engine streams, which aborts their requests


# ---- the middleware --------------------------------------------------------------------------------
class QuotaMetrics:
    def __init__(self, registry: CollectorRegistry | None, names: Iterable[str]) -> None:
        registry = registry if registry is not None else REGISTRY
        self.requests = Counter("kvtide:quota_requests", "Requests per API key (by name) and what became of them.",
                                ["key_name", "outcome"], registry=registry)
        self.tokens = Counter("kvtide:quota_tokens", "Tokens (prompt + completion) charged to each API key.",
                              ["key_name"], registry=registry)
        self.inflight = Gauge("kvtide:quota_inflight", "Requests of each API key being served.", ["key_name"],
                              registry=registry)
        for name in names:  # every key has its series from the start (0), not from its first request
            self.requests.labels(key_name=name, outcome="admitted")
            self.tokens.labels(key_name=name)
            self.inflight.labels(key_name=name)


class QuotaMiddleware:
    """Per-key authentication and limits for HTTP and WebSocket scopes (a plain ASGI middleware:
    responses pass through unbuffered). One registry holds one QuotaMiddleware's metrics: give
    each its own when building several in one process."""

    def __init__(self, app: Callable, api_keys: ApiKeys, registry: CollectorRegistry | None = None,
                 exempt_paths: Iterable[str] = ("/health", "/metrics")) -> None:
        self.app = app
        self.api_keys = api_keys
        self.exempt_paths = tuple(exempt_paths)
        self.tracker = QuotaTracker()
        self.metrics = QuotaMetrics(registry, api_keys.names)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] not in ("http", "websocket") or scope["path"] in self.exempt_paths
                or scope.get(ADMIN_SCOPE_KEY)):  # the admin key, checked by kvtide serve's AdminGate
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        entry = self.api_keys.lookup(api_key_from_headers(headers))
        if entry is None:
            self.metrics.requests.labels(key_name=UNKNOWN_KEY_NAME, outcome="unauthorized").inc()
            await _refuse(scope, receive, send, invalid_api_key(), WS_CLOSE_POLICY)
            return
        refusal = self.tracker.admit(entry)
        if refusal is not None:
            self.metrics.requests.labels(key_name=entry.name, outcome=refusal.outcome).inc()
            logger.info("quota: %s refused (%s)", entry.name, refusal.outcome)
            error = OpenAIError(refusal.message, 429, code="rate_limit_exceeded",
                                headers={"Retry-After": str(refusal.retry_after_s)})
            await _refuse(scope, receive, send, error, WS_CLOSE_TRY_AGAIN_LATER)
            return
        self.metrics.requests.labels(key_name=entry.name, outcome="admitted").inc()
        inflight = self.metrics.inflight.labels(key_name=entry.name)
        inflight.inc()
        counter = TokenCounter()
        tokens_metric = self.metrics.tokens.labels(key_name=entry.name)

        def charge(tokens: int) -> None:
            self.tracker.charge(entry, tokens)
            tokens_metric.inc(tokens)

        reported = UsageCharge(charge)

        async def counting_send(message: Message) -> None:
            if not reported.reported:
                counter.observe(message)
            await send(message)

        try:
            await self.app({**scope, CHARGE_SCOPE_KEY: reported}, receive, counting_send)
        finally:
            self.tracker.release(entry)
            inflight.dec()
            if not reported.reported:
                tokens = counter.total()
                if tokens > 0:
                    charge(tokens)


async def _refuse(scope: Scope, receive: Receive, send: Send, error: OpenAIError, ws_close_code: int) -> None:
    if scope["type"] == "websocket":
        await reject_websocket(receive, send, error, ws_close_code)
    else:
        await send_error(send, error)
