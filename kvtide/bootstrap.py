"""Assemble an engine from EngineArgs: config, tokenizer, executor (model + KV cache), core.

Lives outside engine/ because it is where the policy side meets the device side; both the
offline LLM and the server's engine-core process start here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtide.config import EngineConfig
from kvtide.engine.core import EngineCore
from kvtide.engine_args import CPU_DEFAULT_KV_CACHE_MEMORY, EngineArgs
from kvtide.kv_cache.hybrid import blocks_held
from kvtide.kv_cache.manager import max_blocks_held
from kvtide.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from kvtide.worker.distributed_executor import DistributedExecutor
    from kvtide.worker.executor import UniprocExecutor
    from kvtide.worker.memory_profile import MemoryMeter

    Executor = UniprocExecutor | DistributedExecutor

logger = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    """What the API side needs to know about the model, without loading it."""

    model_dir: str
    tokenizer_dir: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    architecture: str = ""
    """The architecture the model runs as (config.architectures)."""
    model_impl: str = ""
    """The implementation running it: "kvtide" (native) or "transformers" (the fallback)."""
    pooler: dict | None = None
    """A pooling model's PoolerConfig fields and hidden_size, for the API side; None: a generation model."""


def eos_token_ids(model_dir: str, hf_config, load_tokenizer_fn) -> list[int]:
    """EOS ids from generation_config.json (may list several), else config, else the tokenizer
    (loaded only then: transformers takes a second or two to build a large one)."""
    ids = None
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            ids = json.load(f).get("eos_token_id")
    if ids is None:
        ids = getattr(hf_config, "eos_token_id", None)
    if ids is None:
        ids = load_tokenizer_fn().eos_token_id
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


def _num_kv_blocks(config: EngineConfig, bytes_per_block: int, gpu_memory: int | None = None) -> int:
    """Blocks in the pool: kv_cache_memory if given, else `gpu_memory` (CUDA, from
    gpu_memory_utilization), else on CPU a default."""
    cache = config.cache_config
    if cache.kv_cache_memory is not None:
        memory = cache.kv_cache_memory
    elif gpu_memory is not None:
        memory = gpu_memory
    else:
        # No more than the scheduler could ever fill (a block per layer group and position).
        tokens = config.scheduler_config.max_num_seqs * config.model_config.max_model_len
        blocks = tokens // cache.block_size * len(cache.kv_cache_groups or (None,))
        memory = min(CPU_DEFAULT_KV_CACHE_MEMORY, blocks * bytes_per_block + bytes_per_block)
    num_blocks = memory // bytes_per_block
    max_model_len = config.model_config.max_model_len
    # Under a sliding window (or sinks + window) a request holds only the blocks its window spans.
    step = config.scheduler_config.max_num_batched_tokens
    if cache.kv_cache_groups:
        needed = blocks_held(cache.kv_cache_groups, max_model_len, step, cache.block_size)
    else:
        needed = max_blocks_held(max_model_len, step, cache.block_size, cache.sliding_window, cache.kv_sink_tokens)
    if num_blocks < needed:
        utilization = (f"raise gpu_memory_utilization (now {cache.gpu_memory_utilization}), "
                       if cache.kv_cache_memory is None and gpu_memory is not None else "")
        raise ValueError(f"the KV cache holds {num_blocks * cache.block_size} tokens, fewer than a request of "
                         f"max_model_len={max_model_len} needs at once ({needed * cache.block_size}); "
                         f"{utilization}give kv_cache_memory >= {needed * bytes_per_block} bytes or lower "
                         f"max_model_len")
    return num_blocks


def gpu_kv_cache_memory(total: int, utilization: float, used_by_others: int, weights: int,
                        activation_peak: int) -> int:
    """vLLM's sizing: the share of the GPU we may use, less what other processes held before we
    started, our weights and the activation peak of the largest step; the rest is the KV pool's."""
    memory = int(total * utilization) - used_by_others - weights - activation_peak
    logger.info("GPU memory: %.2f GiB x gpu_memory_utilization %.2f, less other processes %.2f GiB, "
                "weights %.2f GiB, activation peak %.2f GiB -> KV cache %.2f GiB", total / 2**30,
                utilization, used_by_others / 2**30, weights / 2**30, activation_peak / 2**30,
                memory / 2**30)
    if memory <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization} leaves no memory for the KV cache: "
                         f"{total * utilization / 2**30:.2f} GiB allowed, other processes hold "
                         f"{used_by_others / 2**30:.2f} GiB, the weights {weights / 2**30:.2f} GiB and the "
                         f"largest step's activations {activation_peak / 2**30:.2f} GiB; raise "
                         f"gpu_memory_utilization or lower max_num_batched_tokens")
    return memory


def _gpu_memory_meter(config: EngineConfig) -> MemoryMeter | None:
    """The CUDA meter when the KV pool is sized from gpu_memory_utilization, else None."""
    if config.device_config.device != "cuda" or config.cache_config.kv_cache_memory is not None:
        return None
    from kvtide.worker.memory_profile import CudaMemoryMeter

    return CudaMemoryMeter()


class _GpuBudget:
    """The readings gpu_kv_cache_memory needs: the device before the model loads, then the weights
    and the peak of a profiled step."""

    def __init__(self, meter: MemoryMeter) -> None:
        free, self.total = meter.device_usage()
        self.used_by_others = self.total - free
        self.allocated_at_start = meter.allocated()
        self.meter = meter

    def kv_cache_memory(self, config: EngineConfig, executor: Executor) -> int:
        weights = self.meter.allocated() - self.allocated_at_start
        activation_peak = executor.profile_peak_activation_bytes(self.meter)
        return gpu_kv_cache_memory(self.total, config.cache_config.gpu_memory_utilization,
                                   self.used_by_others, weights, activation_peak)


def join_replica_expert_group(dp_rank: int, dp_size: int, init_method: str, device: str) -> None:
    """Join the expert-parallel group of the data-parallel replicas sharing their experts, before
    this replica's engine is built: its config checks and MoE layers read the group."""
    from kvtide.devices import uses_cuda
    from kvtide.distributed import init_replica_expert_group

    backend = "nccl" if uses_cuda(device) else "gloo"
    init_replica_expert_group(dp_rank, dp_size, init_method, backend)


def make_executor(config: EngineConfig, model_dir: str, args: EngineArgs) -> Executor:
    """One process for a single-rank replica; else the configured distributed executor (its
    workers rebuild the config from `args`)."""
    backend = config.parallel_config.distributed_executor_backend
    if backend == "mp":
        from kvtide.worker.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config, model_dir, dataclasses.asdict(args))
    if backend == "ray":
        from kvtide.worker.ray_executor import RayExecutor

        return RayExecutor(config, model_dir, dataclasses.asdict(args))
    from kvtide.distributed import refuse_live_process_group
    from kvtide.worker.executor import UniprocExecutor

    refuse_live_process_group()
    return UniprocExecutor(config, model_dir)


def build_engine_core(args: EngineArgs, data_parallel_rank: int | None = None) -> tuple[EngineCore, ModelInfo]:
    model_dir = args.resolve_model_dir()
    config = args.create_engine_config(model_dir)
    meter = _gpu_memory_meter(config)
    budget = _GpuBudget(meter) if meter is not None else None  # read before the weights load
    executor = make_executor(config, model_dir, args)
    gpu_memory = budget.kv_cache_memory(config, executor) if budget is not None else None
    num_blocks = _num_kv_blocks(config, executor.kv_bytes_per_block(), gpu_memory)
    executor.initialize_kv_cache(num_blocks)
    config = config.replace_cache(num_blocks=num_blocks)
    logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, config.cache_config.block_size,
                num_blocks * executor.kv_bytes_per_block() / 2**20)
    memory = _memory_budget(executor, model_dir, config, num_blocks * executor.kv_bytes_per_block())
    info = model_info(args, model_dir, config)
    connector = None
    if config.kv_transfer_config is not None:
        from kvtide.disagg.factory import make_kv_connector

        connector = make_kv_connector(config.kv_transfer_config, executor.runner, config.model_config.model)
        executor.runner.kv_connector = connector.worker
    core = EngineCore(config, executor, lambda: load_tokenizer(info.tokenizer_dir, args.trust_remote_code),
                      connector, data_parallel_rank)
    core.memory = memory
    return core, info


def _memory_budget(executor: Executor, model_dir: str, config: EngineConfig, kv_pool: int) -> dict[str, int] | None:
    """The startup memory budget (worker/memory_budget.py) of the in-process runner, logged; None
    for an executor without one."""
    runner = getattr(executor, "runner", None)
    if runner is None:
        return None
    from kvtide.worker.memory_budget import describe, memory_budget

    budget = memory_budget(runner.model, runner.weight_bytes, kv_pool, model_dir, config.device_config.device)
    logger.info(describe(budget))
    return budget


def model_info(args: EngineArgs, model_dir: str, config: EngineConfig | None = None) -> ModelInfo:
    if config is None:
        config = args.create_engine_config(model_dir)
    tokenizer_dir = args.tokenizer or model_dir
    hf_config = config.model_config.hf_config
    eos = eos_token_ids(model_dir, hf_config, lambda: load_tokenizer(tokenizer_dir, args.trust_remote_code))
    from kvtide.models.registry import architecture_name

    pooler = config.model_config.pooler_config
    pooler_fields = None if pooler is None else \
        {**dataclasses.asdict(pooler), "hidden_size": hf_config.hidden_size}
    return ModelInfo(model_dir, tokenizer_dir, hf_config.vocab_size, config.model_config.max_model_len, eos,
                     architecture_name(hf_config), config.model_config.model_impl, pooler_fields)
