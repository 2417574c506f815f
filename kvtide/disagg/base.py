"""The connector API, in two halves (vLLM's split).

Scheduler half, beside the scheduler (engine-core process):
    get_num_new_matched_tokens(req, n)   tokens past the n computed ones that exist outside the
                                         device; None: not known yet (a transfer is under way), ask
                                         again next step
    update_state_after_alloc(req, n)     the scheduler took blocks for those n external tokens:
                                         plan their load into them
    block_evicted(id, hash)              the device pool is about to reuse a published block
    build_connector_meta(so, requests)   this step's work for the worker half
    request_finished(req, block_ids)     (keep the blocks until the worker reports, params for the
                                         client) when a request ends
    update_connector_output(out)         requests whose kept blocks may now be freed

Worker half, beside the model runner:
    register_kv_caches(block_io)         the caches it reads and writes
    start_load_kv(meta)                  before the step's forward (and before copy-on-write):
                                         copy out evicted blocks, then copy loaded blocks in
    save_kv(meta) -> KVConnectorOutput   after the forward: save what the step computed

Loads complete before the forward starts (per step, not per layer): on CPU, and for host-memory
tiers, a copy costs less than the synchronization a layer-wise overlap would need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtide.disagg.block_io import KVBlockIO
from kvtide.scheduler.output import KVConnectorMetadata, KVConnectorOutput


@dataclass
class ConnectorStats:
    """Counters the metrics read (SchedulerStats.kv_connector)."""

    hit_tokens: dict[str, int] = field(default_factory=dict)
    """tier name -> prompt tokens loaded from it instead of computed."""
    saved_blocks: dict[str, int] = field(default_factory=dict)
    """tier name -> blocks written to it."""
    corrupt_entries: int = 0
    """Entries found truncated, corrupted or of another layout (recomputed, never used)."""
    rejected_entries: int = 0
    """Entries not signed with the deployment's KV secret: unsigned or forged (recomputed, never used)."""
    transfer_failures: int = 0
    """p2p pulls that failed or timed out (the prompt was computed instead)."""
    staged_requests: int = 0
    """p2p: prompts a producer staged for a decode instance."""

    def as_dict(self) -> dict[str, Any]:
        return {"hit_tokens": dict(self.hit_tokens), "saved_blocks": dict(self.saved_blocks),
                "corrupt_entries": self.corrupt_entries, "rejected_entries": self.rejected_entries,
                "transfer_failures": self.transfer_failures,
                "staged_requests": self.staged_requests}


class KVConnectorScheduler:
    stats: ConnectorStats

    def bind(self, kv_cache_manager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size

    def check_request(self, request) -> None:
        """Raise ValueError for a request this connector can never serve (bad kv_transfer_params)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int | None:
        raise NotImplementedError

    def update_state_after_alloc(self, request, num_external_tokens: int) -> None:
        raise NotImplementedError

    def block_evicted(self, block_id: int, block_hash) -> None:
        """Default: evictions are not this connector's concern."""

    @property
    def wants_evictions(self) -> bool:
        return False

    def build_connector_meta(self, scheduler_output, requests: dict) -> KVConnectorMetadata:
        raise NotImplementedError

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """(keep the blocks until the worker reports the request in finished_sending, the
        kv_transfer_params returned to the client)."""
        return False, None

    def update_connector_output(self, output: KVConnectorOutput | None) -> set[str]:
        return set(output.finished_sending) if output is not None else set()

    def has_pending_work(self) -> bool:
        """Work the worker half must still be given even if no request runs."""
        return False

    def wait(self, timeout_s: float) -> None:
        """Called when a step scheduled nothing: block a little instead of spinning."""

    def shutdown(self) -> None:
        pass


class KVConnectorWorker:
    block_io: KVBlockIO

    def register_kv_caches(self, block_io: KVBlockIO) -> None:
        self.block_io = block_io

    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        raise NotImplementedError

    def save_kv(self, metadata: KVConnectorMetadata | None) -> KVConnectorOutput | None:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


@dataclass
class KVConnector:
    """The two halves of one connector, made together (they share its tiers or transfer port)."""

    scheduler: KVConnectorScheduler
    worker: KVConnectorWorker
    name: str

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()
