"""EngineArgs' parallel sizes against the model and the machine: a bad combination is a ValueError
naming the constraint, raised before any process starts or any weight loads."""

from __future__ import annotations

import logging
import os

from kvtide.config import ParallelConfig

logger = logging.getLogger(__name__)

EXECUTOR_BACKENDS = ("mp", "ray")


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def resolve_parallel_config(args, hf_config, device: str, quant_config, speculative) -> ParallelConfig:
    from kvtide.models.registry import resolve_architecture
    from kvtide.models.traits import is_moe, uses_mla

    sizes = {"tensor_parallel_size": args.tensor_parallel_size, "pipeline_parallel_size": args.pipeline_parallel_size,
             "data_parallel_size": args.data_parallel_size}
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    tp, pp, dp = args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size
    world = tp * pp
    arch = resolve_architecture(hf_config)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's attention heads ({heads})")
    if kv_heads >= tp and kv_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's KV heads ({kv_heads}), or be a "
                         f"multiple of them (KV heads are then replicated)")
    if kv_heads < tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} exceeds the model's KV heads ({kv_heads}) and is not a "
                         f"multiple of them, so they cannot be replicated evenly")
    layers = hf_config.num_hidden_layers
    if pp > layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's layers ({layers}): every stage "
                         f"needs at least one")
    if args.enable_expert_parallel and not is_moe(hf_config):
        raise ValueError(f"--enable-expert-parallel applies to mixture-of-experts models; {arch} has no experts")
    if args.data_parallel_size_local is not None and not 1 <= args.data_parallel_size_local <= dp:
        raise ValueError(f"data_parallel_size_local must be in [1, data_parallel_size={dp}], "
                         f"got {args.data_parallel_size_local}")
    backend = args.distributed_executor_backend
    if backend is not None and backend not in EXECUTOR_BACKENDS:
        raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}; "
                         f"got {backend!r}")
    threads = args.cpu_threads_per_rank
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"cpu_threads_per_rank must be an integer >= 1, got {threads!r}")
    if world > 1:
        _check_features(args, hf_config, arch, tp, pp, quant_config, speculative, is_moe, uses_mla)
        if backend != "ray":  # a Ray cluster's devices are checked when its workers are placed
            _check_devices(device, world, threads)
    return ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                          data_parallel_size_local=args.data_parallel_size_local,
                          data_parallel_address=args.data_parallel_address or "127.0.0.1",
                          data_parallel_rpc_port=args.data_parallel_rpc_port,
                          enable_expert_parallel=args.enable_expert_parallel,
                          distributed_executor_backend=(backend or "mp") if world > 1 else "uni",
                          cpu_threads_per_rank=threads)


def _check_devices(device: str, world: int, threads: int | None) -> None:
    if device == "cuda":
        import torch

        count = torch.cuda.device_count()
        if world > count:
            raise ValueError(f"a replica of {world} ranks needs {world} GPUs; this node has {count} "
                             f"(--distributed-executor-backend ray places ranks on other nodes)")
        return
    cpus = usable_cpus()
    if threads is None and world > cpus:
        raise ValueError(f"a replica of {world} ranks needs at least {world} CPUs to give each rank its own; "
                         f"{cpus} are usable here (pass --cpu-threads-per-rank to share cores on purpose)")


def _check_features(args, hf_config, arch: str, tp: int, pp: int, quant_config, speculative,
                    is_moe, uses_mla) -> None:
    """What multi-rank replicas do not combine with yet: refused by name rather than run wrongly."""
    if quant_config is not None:
        raise ValueError(f"--quantization ({quant_config.name}) does not combine with tensor or pipeline "
                         f"parallelism yet; run the quantized model with world size 1")
    if speculative is not None:
        raise ValueError("speculative decoding does not combine with tensor or pipeline parallelism yet")
    if uses_mla(hf_config):
        raise ValueError(f"{arch}'s latent (MLA) attention does not run tensor or pipeline parallel yet")
    if is_moe(hf_config) and tp > 1 and not args.enable_expert_parallel:
        raise ValueError(f"{arch} is a mixture-of-experts model: with tensor_parallel_size > 1 pass "
                         f"--enable-expert-parallel (experts are split whole between the ranks)")
    if is_moe(hf_config) and pp > 2:
        logger.warning(
            "expert-load statistics of a pipeline of %d stages cover the first and last stages' layers only", pp)
    if args.kv_drop_policy is not None:
        raise ValueError("--kv-drop-policy does not combine with tensor or pipeline parallelism yet")
