"""KVEventsConfig: `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvtide.json_flags import json_object_flag

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    """Record the block pool's stored and removed blocks; off, the pool pays nothing."""
    publisher: str = "zmq"
    """zmq (PUB socket plus a replay ROUTER socket) or null (recorded, then dropped: for tests)."""
    endpoint: str = "tcp://127.0.0.1:5557"
    """Where the PUB socket binds (a connect-style address such as tcp://router:5557 is not
    taken). Loopback by default, unlike vLLM's tcp://*: the events carry prompt token ids, so
    other hosts get them only when told (tcp://*:5557). With data parallelism each replica binds
    this port plus its rank."""
    replay_endpoint: str | None = "tcp://127.0.0.1:5558"
    """Where the replay ROUTER binds (None: no replay); a subscriber that saw a gap asks for the
    batches from a sequence number on, as vLLM's subscriber does."""
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    hwm: int = 100_000
    """ZMQ send high-water mark of the PUB socket (messages queued for a slow subscriber)."""
    max_queue_size: int = 100_000
    """Batches waiting for the publisher thread; past it a batch is dropped and counted, never
    making the engine's step wait."""
    topic: str = "kv-events"


def parse_kv_events_config(value: str | dict | None) -> KVEventsConfig | None:
    """The config of a JSON text or a dict; None when events are off. ValueError names a bad field."""
    if value is None or value == "":
        return None
    value = json_object_flag(value, "--kv-events-config")
    known = {f.name: f for f in fields(KVEventsConfig)}
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}")
    config = KVEventsConfig(**value)
    _check(config, value)
    return config if config.enable_kv_cache_events else None


def _check(config: KVEventsConfig, raw: dict[str, Any]) -> None:
    if not isinstance(config.enable_kv_cache_events, bool):
        raise ValueError("--kv-events-config: enable_kv_cache_events must be true or false")
    if config.publisher not in PUBLISHERS:
        raise ValueError(f"--kv-events-config: publisher must be one of {', '.join(PUBLISHERS)}, "
                         f"got {config.publisher!r}")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        number = getattr(config, name)
        if not isinstance(number, int) or isinstance(number, bool) or number < 1:
            raise ValueError(f"--kv-events-config: {name} must be a positive integer, got {raw.get(name)!r}")
    for name in ("endpoint", "replay_endpoint"):
        address = getattr(config, name)
        if address is None and name == "replay_endpoint":
            continue
        if not isinstance(address, str) or "://" not in address:
            raise ValueError(f"--kv-events-config: {name} must be a ZMQ address such as tcp://127.0.0.1:5557, "
                             f"got {address!r}")
    if not isinstance(config.topic, str):
        raise ValueError("--kv-events-config: topic must be a string")
