"""The tier connectors: cpu_offload, redis and multi (host memory over Redis).

    device pool ──evicted──▶ host memory (this instance; LRU, --kv-offload-memory)
        │
        └──computed──▶ Redis (every instance; written through as blocks fill, off the step's path)

A waiting request's prompt is looked up past its device prefix hit, fastest tier first, block by
block along its hash chain; what is found is loaded into its new blocks before the step's forward
and counted as cached tokens. Host memory is fed by evictions (a block costs nothing until the pool
reuses it); Redis is written through, so another instance finds a prompt as soon as it is computed,
not when it falls out of two tiers here.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

from kvtide.disagg.base import (
    ConnectorStats,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from kvtide.disagg.tiers import CPUTier, RedisTier

logger = logging.getLogger(__name__)

WRITE_QUEUE_BLOCKS = 4096
"""Blocks waiting for the Redis writer; past it new blocks are not written (counted as skipped)."""


@dataclass
class TierMetadata(KVConnectorMetadata):
    evicted: list[tuple[int, bytes]] = field(default_factory=list)
    """(block id, key): published blocks the pool is reusing this step; copied to host memory first."""
    loads: list[tuple[int, bytes]] = field(default_factory=list)
    """(block id, payload): found in a tier, copied in before the forward."""
    write_through: list[tuple[int, bytes]] = field(default_factory=list)
    """(block id, key): blocks this step fills, for Redis."""


class TieredScheduler(KVConnectorScheduler):
    def __init__(self, cpu: CPUTier | None, redis: RedisTier | None) -> None:
        self.cpu = cpu
        self.redis = redis
        self.tiers = [t for t in (cpu, redis) if t is not None]
        self.stats = ConnectorStats()
        self._found: dict[str, dict[int, tuple[bytes, str]]] = {}
        """request id -> block index -> (payload, tier) looked up while it waits."""
        self._loads: list[tuple[int, bytes]] = []
        self._evicted: list[tuple[int, bytes]] = []
        self._written_upto: dict[str, int] = {}
        """request id -> blocks of it already handed to the Redis writer."""

    @property
    def wants_evictions(self) -> bool:
        return self.cpu is not None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        if not self.kv_cache_manager.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return 0
        start = num_computed_tokens // self.block_size
        end = (request.num_tokens - 1) // self.block_size
        found = self._found.setdefault(request.request_id, {})
        i = start
        while i < end and i in found:
            i += 1
        if i < end:
            for tier in self.tiers:
                keys = [h.hash_value for h in request.block_hashes[i:end]]
                for payload in tier.get_chain(keys):
                    found[i] = (payload, tier.name)
                    i += 1
                if i == end:
                    break
        if self.redis is not None:
            self.stats.corrupt_entries = self.redis.num_corrupt
            self.stats.rejected_entries = self.redis.num_rejected
        return (i - start) * self.block_size

    def update_state_after_alloc(self, request, num_external_tokens: int) -> None:
        found = self._found.pop(request.request_id, {})
        if not num_external_tokens:
            return
        start = request.num_computed_tokens // self.block_size
        blocks = self.kv_cache_manager.req_to_blocks[request.request_id]
        for i in range(start, start + num_external_tokens // self.block_size):
            payload, tier = found[i]
            self._loads.append((blocks[i].block_id, payload))
            self.stats.hit_tokens[tier] = self.stats.hit_tokens.get(tier, 0) + self.block_size

    def block_evicted(self, block_id: int, block_hash) -> None:
        if block_hash.hash_value not in self.cpu:  # type: ignore[operator]
            self._evicted.append((block_id, block_hash.hash_value))

    def build_connector_meta(self, scheduler_output, requests: dict) -> TierMetadata:
        meta = TierMetadata(self._evicted, self._loads)
        self._evicted, self._loads = [], []
        if self.redis is not None:
            for req_id in scheduler_output.num_scheduled_tokens:
                meta.write_through.extend(self._newly_published(requests[req_id]))
        return meta

    def _newly_published(self, request) -> list[tuple[int, bytes]]:
        """Blocks of `request` published (full, hashed) since it was last asked."""
        req_id = request.request_id
        blocks = self.kv_cache_manager.req_to_blocks.get(req_id, [])
        upto = self._written_upto.get(req_id, 0)
        out = []
        while upto < len(blocks) and getattr(blocks[upto], "block_hash", None) is not None:
            out.append((blocks[upto].block_id, blocks[upto].block_hash.hash_value))
            upto += 1
        self._written_upto[req_id] = upto
        return out

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._found.pop(request.request_id, None)
        self._written_upto.pop(request.request_id, None)
        return False, None


class TieredWorker(KVConnectorWorker):
    def __init__(self, cpu: CPUTier | None, redis: RedisTier | None, stats: ConnectorStats) -> None:
        self.cpu = cpu
        self.redis = redis
        self.stats = stats
        self._queue: queue.Queue[list[tuple[bytes, bytes]] | None] = queue.Queue()
        self._queued_blocks = 0
        self._writer: threading.Thread | None = None
        if redis is not None:
            self._writer = threading.Thread(target=self._write_loop, name="kvtide-redis-writer", daemon=True)
            self._writer.start()

    def start_load_kv(self, meta: TierMetadata | None) -> None:
        if meta is None:
            return
        if meta.evicted and self.cpu is not None:
            ids, keys = zip(*meta.evicted, strict=True)
            for key, payload in zip(keys, self.block_io.read(list(ids)), strict=True):
                self.cpu.put(key, payload)
            self.stats.saved_blocks["cpu"] = self.stats.saved_blocks.get("cpu", 0) + len(keys)
        if meta.loads:
            ids, payloads = zip(*meta.loads, strict=True)
            self.block_io.write(list(ids), list(payloads))

    def save_kv(self, meta: TierMetadata | None) -> KVConnectorOutput | None:
        if meta is None or not meta.write_through or self.redis is None:
            return None
        if self._queued_blocks + len(meta.write_through) > WRITE_QUEUE_BLOCKS:
            logger.warning("KV tier: the Redis writer is %d blocks behind; not writing %d more",
                           self._queued_blocks, len(meta.write_through))
            return None
        ids, keys = zip(*meta.write_through, strict=True)
        self._queued_blocks += len(keys)
        self._queue.put(list(zip(keys, self.block_io.read(list(ids)), strict=True)))
        return None

    def _write_loop(self) -> None:
        import redis

        while True:
            items = self._queue.get()
            if items is None:
                return
            try:
                missing = set(self.redis.missing([k for k, _ in items]))
                fresh = [(k, p) for k, p in items if k in missing]
                if fresh:
                    self.redis.put_many(fresh)
                    self.stats.saved_blocks["redis"] = self.stats.saved_blocks.get("redis", 0) + len(fresh)
            except redis.RedisError as e:
                logger.warning("KV tier: Redis write failed (%s)", e)
            finally:
                self._queued_blocks -= len(items)
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every block handed to the Redis writer is written (tests, shutdown)."""
        if self._writer is not None:
            self._queue.join()

    def shutdown(self) -> None:
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout=10.0)
            self._writer = None
        if self.redis is not None:
            self.redis.close()
