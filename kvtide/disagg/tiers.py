"""External KV tiers, fastest first: host memory (this instance only) and Redis (every instance).

A tier maps a block key (the prefix cache's chain hash, which names the whole prefix up to and
including the block) to the block's bytes. `get_chain` returns the leading run of keys it holds:
a block is only useful after the blocks before it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from urllib.parse import urlsplit, urlunsplit

from kvtide.disagg.entry import pack, unpack

logger = logging.getLogger(__name__)

REDIS_BATCH = 16
"""Keys per pipelined round trip: enough to hide the latency, few enough to stop soon at a miss."""


class CPUTier:
    """Blocks in host memory, least recently used evicted past `capacity_bytes`."""

    name = "cpu"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: bytes, payload: bytes) -> None:
        if len(payload) > self.capacity_bytes:
            return
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            while self.used_bytes + len(payload) > self.capacity_bytes:
                _, old = self._entries.popitem(last=False)
                self.used_bytes -= len(old)
            self._entries[key] = payload
            self.used_bytes += len(payload)

    def get_chain(self, keys: list[bytes]) -> list[bytes]:
        out = []
        with self._lock:
            for key in keys:
                payload = self._entries.get(key)
                if payload is None:
                    break
                self._entries.move_to_end(key)
                out.append(payload)
        return out


def redact(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class RedisTier:
    """Blocks in Redis under `kvtide:kv:<model>:<layout>:<hash>`, each a checked entry (entry.py):
    a truncated or corrupted value is deleted and reported, never loaded."""

    name = "redis"

    def __init__(self, url: str, namespace: str, layout_id: str, ttl_s: int | None,
                 maxmemory: str | None = None) -> None:
        import redis

        kwargs = {}
        if urlsplit(url).password is None and os.environ.get("REDIS_PASSWORD"):
            kwargs = {"username": os.environ.get("REDIS_USERNAME"), "password": os.environ["REDIS_PASSWORD"]}
        self.client = redis.Redis.from_url(url, socket_timeout=10.0, socket_connect_timeout=5.0, **kwargs)
        self.prefix = f"kvtide:kv:{namespace}:{layout_id}:".encode()
        self.layout_id = layout_id
        self.ttl_s = ttl_s
        self.num_corrupt = 0
        try:
            self.client.ping()
            if maxmemory is not None:
                self.client.config_set("maxmemory", maxmemory)
                self.client.config_set("maxmemory-policy", "allkeys-lru")
        except redis.RedisError as e:
            raise ValueError(f"cannot reach Redis at {redact(url)}: {e}") from None
        logger.info("KV tier: Redis at %s (ttl %s s)", redact(url), ttl_s)

    def _key(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    def get_chain(self, keys: list[bytes]) -> list[bytes]:
        import redis

        out: list[bytes] = []
        try:
            for start in range(0, len(keys), REDIS_BATCH):
                batch = [self._key(k) for k in keys[start:start + REDIS_BATCH]]
                pipe = self.client.pipeline(transaction=False)
                for k in batch:
                    pipe.get(k)
                for redis_key, blob in zip(batch, pipe.execute(), strict=True):
                    payload = unpack(self.layout_id, blob)
                    if payload is None:
                        if blob is not None:
                            self.num_corrupt += 1
                            logger.warning("KV tier: dropping a damaged Redis entry (%d bytes)", len(blob))
                            self.client.delete(redis_key)
                        return out
                    out.append(payload)
        except redis.RedisError as e:
            logger.warning("KV tier: Redis read failed (%s); computing instead", e)
        return out

    def missing(self, keys: list[bytes]) -> list[bytes]:
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(self._key(k))
        return [k for k, n in zip(keys, pipe.execute(), strict=True) if not n]

    def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key, payload in items:
            pipe.set(self._key(key), pack(self.layout_id, payload), ex=self.ttl_s)
        pipe.execute()

    def close(self) -> None:
        self.client.close()
