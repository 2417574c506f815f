"""EngineArgs' parallel sizes against the model and the machine: a bad combination is a ValueError
naming the constraint, raised before any process starts or any weight loads."""

from __future__ import annotations

import logging
import os

from kvtide.config import ParallelConfig
from kvtide.distributed.parallel_state import experts_span_replicas

logger = logging.getLogger(__name__)

EXECUTOR_BACKENDS = ("mp", "ray")


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def resolve_parallel_config(args, hf_config, device: str, quant_config, speculative) -> ParallelConfig:
    from kvtide.models.registry import architecture_name
    from kvtide.models.traits import is_moe, uses_mla

    sizes = {"tensor_parallel_size": args.tensor_parallel_size, "pipeline_parallel_size": args.pipeline_parallel_size,
             "data_parallel_size": args.data_parallel_size}
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    tp, pp, dp = args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size
    world = tp * pp
    arch = architecture_name(hf_config)
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
    if experts_span_replicas():
        _check_experts_across_replicas(args, world, speculative)
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
    if quant_config is not None:  # each rank loads or quantizes its shard; the scheme says what it cannot split
        quant_config.check_parallel(hf_config, tp, pp)
    if speculative is not None:
        _check_speculative(speculative, tp, pp)
    if is_moe(hf_config) and tp > 1:
        _check_tensor_parallel_experts(args, hf_config, arch, tp, quant_config)
    if is_moe(hf_config) and pp > 2:
        logger.warning(
            "expert-load statistics of a pipeline of %d stages cover the first and last stages' layers only", pp)
    if args.kv_drop_policy is not None and pp > 1 and args.enable_chunked_prefill:
        raise ValueError(f"--kv-drop-policy under pipeline parallelism (pipeline_parallel_size={pp}) needs "
                         f"--no-enable-chunked-prefill: a prompt's next chunk is scheduled while the previous "
                         f"one's attention scores are still in later stages, and each micro-batch's token "
                         f"budget splits prompts differently from world size 1, so blocks would be dropped "
                         f"at other points")


def _check_experts_across_replicas(args, world: int, speculative) -> None:
    """Data-parallel replicas sharing their experts (--enable-expert-parallel with
    --data-parallel-size > 1) step in lockstep, one pass through the MoE layers each: a replica of
    one rank, scheduling synchronously, with no second model (a draft's passes would not match)."""
    if world > 1:
        raise ValueError("--enable-expert-parallel with --data-parallel-size > 1 shares the experts between "
                         "replicas of one rank each; with tensor or pipeline parallelism inside the replicas as "
                         "well it is not built: use --tensor-parallel-size 1 --pipeline-parallel-size 1, or "
                         "drop --data-parallel-size (the experts are then split within the replica)")
    if args.async_scheduling:
        raise ValueError("--async-scheduling does not combine with experts shared between data-parallel replicas "
                         "(--enable-expert-parallel with --data-parallel-size > 1): they step in lockstep")
    if speculative is not None and speculative.method != "ngram":
        raise ValueError(f"speculative method {speculative.method!r} does not combine with experts shared between "
                         f"data-parallel replicas: its extra passes would not match the other replicas' "
                         f"exchanges; use method 'ngram'")


def _check_speculative(speculative, tp: int, pp: int) -> None:
    """Speculative decoding on several ranks (spec_decode/parallel.py): n-gram drafts under tensor
    and pipeline parallelism; a draft model and an EAGLE / EAGLE-3 head (both sharded over the TP
    group) and layer skip under tensor parallelism; Medusa heads (replicated blocks,
    vocabulary-parallel LM heads over the target's full hidden states) under tensor parallelism.
    The rest is refused by name, with the reason."""
    method = speculative.method
    if pp > 1 and method != "ngram":
        raise ValueError(
            f"speculative method {method!r} does not combine with pipeline parallelism "
            f"(pipeline_parallel_size={pp}): the first stage needs the drafts as inputs, but "
            + ("the target's early-exit layers and its LM head sit on different stages"
               if method == "layer_skip" else
               "a draft model would have to be split into the same stages" if method == "draft_model" else
               "the head reads the target's last hidden states, which only the last stage holds")
            + "; use method 'ngram', or tensor parallelism")
    if tp == 1 or method not in ("draft_model", "eagle", "eagle3"):
        return
    if method == "draft_model":  # sharded over the target's TP group
        draft, what = speculative.draft_hf_config, "the draft model's"
        if draft is None:
            return
        heads = draft.num_attention_heads
        kv_heads = getattr(draft, "num_key_value_heads", None) or heads
        inter = getattr(draft, "intermediate_size", None)
    else:  # the head's decoder layer(s), sharded like the target's
        from kvtide.spec_decode.heads.loading import read_head_config

        head, what = read_head_config(speculative.model), "the EAGLE head's"
        heads = head.get("num_attention_heads", 32)
        kv_heads = head.get("num_key_value_heads") or heads
        inter = head.get("intermediate_size")
    if heads % tp or (kv_heads >= tp and kv_heads % tp) or (kv_heads < tp and tp % kv_heads):
        raise ValueError(f"tensor_parallel_size={tp} must divide {what} attention heads ({heads}) and its "
                         f"KV heads ({kv_heads}) or be a multiple of them: it is sharded over the same "
                         f"tensor-parallel ranks as the target")
    if inter and inter % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide {what} intermediate size ({inter}): its "
                         f"MLP is sharded over the same tensor-parallel ranks as the target")


def _check_tensor_parallel_experts(args, hf_config, arch: str, tp: int, quant_config) -> None:
    """A MoE model under tp > 1: without --enable-expert-parallel every expert's intermediate
    dimension is split over the ranks (layers/moe/layer.py), so it must divide; the shared experts
    are split like a dense MLP either way."""
    shared = getattr(hf_config, "shared_expert_intermediate_size", None)  # Qwen2-MoE
    if shared and shared % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide {arch}'s shared expert intermediate size "
                         f"({shared})")
    if args.enable_expert_parallel:
        return
    intermediate = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
    if intermediate % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide {arch}'s expert intermediate size "
                         f"({intermediate}): each rank holds 1/tp of every expert; or pass "
                         f"--enable-expert-parallel to split the experts whole between the ranks")
    if quant_config is not None:
        raise ValueError(f"--quantization ({quant_config.name}) of experts split over tensor-parallel ranks "
                         f"is not supported; pass --enable-expert-parallel (experts split whole) or run "
                         f"with world size 1")
