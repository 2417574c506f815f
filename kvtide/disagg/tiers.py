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

from kvtide.disagg.entry import CORRUPT, FORGED, pack, unpack

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
    """Blocks in Redis under `kvtide:kv:<model>:<layout>:<hash>`, each a checked entry signed with
    the deployment's KV secret (entry.py): a truncated, corrupted, unsigned or forged value is
    deleted (so a genuine one can be written in its place) and counted, never loaded."""

    name = "redis"

    def __init__(self, url: str, namespace: str, layout_id: str, ttl_s: int | None,
                 maxmemory: str | None = None, *, secret: bytes) -> None:
        import redis

        kwargs = {}
        if urlsplit(url).password is None and os.environ.get("REDIS_PASSWORD"):
            kwargs = {"username": os.environ.get("REDIS_USERNAME"), "password": os.environ["REDIS_PASSWORD"]}
        self.client = redis.Redis.from_url(url, socket_timeout=10.0, socket_connect_timeout=5.0, **kwargs)
        self.prefix = f"kvtide:kv:{namespace}:{layout_id}:".encode()
        self.layout_id = layout_id
        self.ttl_s = ttl_s
        self.secret = secret
        self.num_corrupt = 0
        self.num_rejected = 0
        """Entries not signed with this deployment's secret (unsigned, forged, or another deployment's)."""
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
                    payload = unpack(self.secret, redis_key, self.layout_id, blob)
                    if payload is None:
                        return out
                    if payload == CORRUPT:
                        self.num_corrupt += 1
                        logger.warning("KV tier: dropping a damaged Redis entry (%d bytes)", len(blob))
                        self.client.delete(redis_key)
                        return out
                    if payload == FORGED:
                        self.num_rejected += 1
                        logger.warning("KV tier: dropping a Redis entry not signed with this deployment's KV secret "
                                       "(%s, %d bytes): forged, or written by an instance with another secret",
                                       redis_key.decode(errors="replace"), len(blob))
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
            redis_key = self._key(key)
            pipe.set(redis_key, pack(self.secret, redis_key, self.layout_id, payload), ex=self.ttl_s)
        pipe.execute()

    def close(self) -> None:
        self.client.close()
