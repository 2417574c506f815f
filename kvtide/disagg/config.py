"""KVTransferConfig: `--kv-transfer-config '{"kv_connector": ..., "kv_role": ..., ...}'` (vLLM's
names where vLLM has them), parsed and checked before anything starts."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field, fields
from typing import Any

from kvtide.json_flags import json_object_flag

CONNECTORS = ("cpu_offload", "redis", "multi", "p2p")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
SECRET_ENV = "KVTIDE_KV_SECRET"
"""Where the p2p and Redis connectors read the shared secret when the config does not hold one."""
SIGNED_CONNECTORS = ("p2p", "redis", "multi")
"""Connectors whose traffic other hosts can write (a transfer port, a shared Redis): they need the
deployment's KV secret, and refuse to start without it."""


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    """cpu_offload, redis, multi (cpu_offload over redis) or p2p."""
    kv_role: str = "kv_both"
    """p2p: kv_producer (a prefill instance: stages prompts for decode instances), kv_consumer (a
    decode instance: pulls them) or kv_both. The tier connectors both load and save."""
    kv_ip: str = "127.0.0.1"
    """p2p: the address a producer's transfer port binds (loopback unless told otherwise)."""
    kv_port: int = 0
    """p2p: a producer's transfer port (0: any free port, reported in kv_transfer_params)."""
    kv_secret: str | None = field(default=None, repr=False)
    """p2p, redis, multi: the deployment's shared secret (default: $KVTIDE_KV_SECRET), never logged:
    p2p pulls are authenticated with it and Redis entries signed with it."""
    kv_stage_ttl_s: float = 60.0
    """p2p: how long a producer keeps a staged prompt no decode instance has pulled."""
    kv_stage_max_bytes: int = 1 << 30
    """p2p: host memory a producer's staged prompts may take; past it a prompt is not staged (its
    decode instance computes it)."""
    kv_transfer_timeout_s: float = 30.0
    """p2p: how long a consumer waits for a pull before computing the prompt itself."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """redis/multi: the store (credentials in the URL, or REDIS_USERNAME / REDIS_PASSWORD)."""
    redis_ttl_s: int | None = 3600
    """redis/multi: seconds an entry lives after it is written (None: until Redis evicts it)."""
    redis_maxmemory: str | None = None
    """redis/multi: if set (e.g. "2gb"), CONFIG SET the server's maxmemory to it with the
    allkeys-lru policy at start (for a Redis this deployment owns); None leaves the server's own."""
    kv_offload_memory: int = 1 << 30
    """cpu_offload/multi: host memory for evicted device blocks (--kv-offload-memory)."""

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def secret(self) -> bytes:
        value = self.kv_secret if self.kv_secret is not None else os.environ.get(SECRET_ENV)
        if not value:
            raise ValueError(f"the {self.kv_connector} KV connector needs a shared secret (p2p pulls are "
                             f"authenticated and Redis entries signed with it): set ${SECRET_ENV} (or kv_secret "
                             f"in --kv-transfer-config), the same on every instance")
        return value.encode()


def parse_kv_transfer_config(value: str | dict | None, kv_offload_memory: int | None = None) -> KVTransferConfig | None:
    """The config from JSON text or a dict; ValueError naming the bad field."""
    if value is None:
        if kv_offload_memory is not None:
            return KVTransferConfig("cpu_offload", kv_offload_memory=kv_offload_memory)
        return None
    value = json_object_flag(value, "--kv-transfer-config")
    known = {f.name: f for f in fields(KVTransferConfig)}
    unknown = sorted(set(value) - set(known) - {"kv_connector_extra_config"})
    if unknown:
        raise ValueError(f"--kv-transfer-config: unknown field(s) {unknown}; known: {sorted(known)}")
    merged: dict[str, Any] = {**value.get("kv_connector_extra_config", {}),
                              **{k: v for k, v in value.items() if k != "kv_connector_extra_config"}}
    if kv_offload_memory is not None:
        merged["kv_offload_memory"] = kv_offload_memory
    config = KVTransferConfig(**{k: v for k, v in merged.items() if k in known})
    _check(config)
    return config


def _check(c: KVTransferConfig) -> None:
    if c.kv_connector not in CONNECTORS:
        raise ValueError(f"kv_connector must be one of {list(CONNECTORS)}, got {c.kv_connector!r}")
    if c.kv_role not in ROLES:
        raise ValueError(f"kv_role must be one of {list(ROLES)}, got {c.kv_role!r}")
    if not isinstance(c.kv_port, int) or not 0 <= c.kv_port < 65536:
        raise ValueError(f"kv_port must be an integer in [0, 65535], got {c.kv_port!r}")
    for name in ("kv_stage_ttl_s", "kv_transfer_timeout_s"):
        if not isinstance(getattr(c, name), (int, float)) or getattr(c, name) <= 0:
            raise ValueError(f"{name} must be a positive number, got {getattr(c, name)!r}")
    for name in ("kv_stage_max_bytes", "kv_offload_memory"):
        if not isinstance(getattr(c, name), int) or getattr(c, name) <= 0:
            raise ValueError(f"{name} must be a positive integer (bytes), got {getattr(c, name)!r}")
    if c.redis_ttl_s is not None and (not isinstance(c.redis_ttl_s, int) or c.redis_ttl_s <= 0):
        raise ValueError(f"redis_ttl_s must be a positive integer or null, got {c.redis_ttl_s!r}")
    if c.kv_connector in ("redis", "multi") and not str(c.redis_url).startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("redis_url must start with redis://, rediss:// or unix://")
    if c.kv_connector in ("redis", "multi") and importlib.util.find_spec("redis") is None:
        raise ValueError(f"kv_connector {c.kv_connector!r} needs the redis package, kvtide's redis extra: "
                         "pip install 'kvtide[redis]' (from a checkout: pip install -e '.[redis]')")
    if c.kv_connector in SIGNED_CONNECTORS:
        c.secret()
