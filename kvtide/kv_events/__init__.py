"""KV-cache events: what the block pool publishes and forgets, told to the outside as vLLM's
`KVEventBatch` messages over ZMQ, so llm-d's and Dynamo's KV-aware routers (and kvtide's own)
see the engines' real caches.

- `config.py`: `--kv-events-config` (vLLM's field names), parsed and checked before start.
- `events.py`: the wire types and the recorder the block pool reports to (`BlockPool.event_sink`).
- `publisher.py`: the ZMQ publisher thread (PUB for live batches, ROUTER for replay by sequence).
"""

from kvtide.kv_events.config import KVEventsConfig, parse_kv_events_config
from kvtide.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventRecorder,
    external_block_hash,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "KVEventRecorder",
    "KVEventsConfig",
    "external_block_hash",
    "parse_kv_events_config",
]
