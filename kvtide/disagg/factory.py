"""make_kv_connector: the configured connector's two halves, bound to one engine's KV cache."""

from __future__ import annotations

import hashlib
import re

import torch

from kvtide.disagg.base import KVConnector
from kvtide.disagg.config import KVTransferConfig


def model_namespace(model_name: str, hf_config, model: torch.nn.Module) -> str:
    """The model part of a shared tier's keys: its name (for people reading keys) and a fingerprint
    of its config and weights, so two checkpoints of one shape (a fine-tune) never share entries."""
    digest = hashlib.sha256(hf_config.to_json_string(use_diff=False).encode())
    params = list(model.parameters())
    for p in (params[0], params[-1]) if params else ():
        digest.update(p.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes())
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name.rstrip("/").rsplit("/", 1)[-1])[:48]
    return f"{name}-{digest.hexdigest()[:12]}"


def make_kv_connector(config: KVTransferConfig, runner, model_name: str) -> KVConnector:
    """Both halves of `config.kv_connector`, the worker half bound to `runner`'s caches. The caller
    hands the scheduler half to the Scheduler."""
    block_io = runner.kv_block_io()
    if config.kv_connector == "p2p":
        from kvtide.disagg.p2p import P2PScheduler, P2PWorker, StagingStore, TransferServer

        store = server = None
        if config.is_producer:
            store = StagingStore(config.kv_stage_ttl_s, config.kv_stage_max_bytes)
            server = TransferServer(store, config.secret(), block_io.layout_id, config.kv_ip, config.kv_port)
        scheduler = P2PScheduler(config, store, server, block_io.layout_id, block_io.block_bytes)
        worker = P2PWorker(store, config.kv_stage_ttl_s)
        worker.server = server
    else:
        from kvtide.disagg.tiered import TieredScheduler, TieredWorker
        from kvtide.disagg.tiers import CPUTier, RedisTier

        cpu = CPUTier(config.kv_offload_memory) if config.kv_connector in ("cpu_offload", "multi") else None
        redis = None
        if config.kv_connector in ("redis", "multi"):
            namespace = model_namespace(model_name, runner.config.model_config.hf_config, runner.model)
            redis = RedisTier(config.redis_url, namespace, block_io.layout_id, config.redis_ttl_s,
                              config.redis_maxmemory, secret=config.secret())
        scheduler = TieredScheduler(cpu, redis)
        worker = TieredWorker(cpu, redis, scheduler.stats)
    worker.register_kv_caches(block_io)
    return KVConnector(scheduler, worker, config.kv_connector)
