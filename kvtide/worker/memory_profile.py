"""How much device memory one step needs beyond the weights: a dummy step at the largest batch.

On CUDA the KV pool gets what gpu_memory_utilization leaves after the weights *and* a step's
transient tensors (activations, logits, sampler buffers). Sizing from the weights alone hands the
activations' share to the pool, and the first full batch runs out of memory. So, as vLLM does,
run the largest step the scheduler can ever form once, through the runner's normal path on a
throwaway KV cache, and read the allocator's peak.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvtide.config import EngineConfig
from kvtide.sampling_params import MAX_LOGPROBS, SamplingParams
from kvtide.scheduler.output import NewRequestData, SchedulerOutput
from kvtide.worker.model_runner import ModelRunner, has_own_cache_layout, layer_cache_shape

PROFILE_REQUEST_PREFIX = "__profile-"
"""Dummy request ids; real ones come from the engine's counter and never start with this."""


class MemoryMeter(Protocol):
    """Reads of the device and its allocator; a protocol so CPU tests can script the numbers."""

    def device_usage(self) -> tuple[int, int]:
        """(free, total) bytes of the device, as every process sees it."""
        ...

    def allocated(self) -> int:
        """Bytes this process's tensors hold now."""
        ...

    def reset_peak(self) -> None: ...

    def peak(self) -> int:
        """Most bytes held at once since reset_peak."""
        ...


class CudaMemoryMeter:
    """MemoryMeter of the current CUDA device."""

    def device_usage(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()


def largest_batch(config: EngineConfig) -> list[int]:
    """Tokens per request of the largest step: max_num_batched_tokens spread evenly over
    max_num_seqs requests (at least one token each, so no more requests than tokens), capped at
    what max_num_seqs requests of max_model_len tokens can hold."""
    sc = config.scheduler_config
    num_tokens = min(sc.max_num_batched_tokens, sc.max_num_seqs * config.model_config.max_model_len)
    num_reqs = min(sc.max_num_seqs, num_tokens)
    base, extra = divmod(num_tokens, num_reqs)
    return [base + 1 if i < extra else base for i in range(num_reqs)]


def _worst_case_params(seed: int) -> SamplingParams:
    """Sampling that takes every memory-hungry path of the sampler: penalties (token counts), top-k
    and top-p (a full sort), min-p, logprobs. Seeded, so the draw uses its own generator and leaves
    the runner's shared one untouched."""
    return SamplingParams(temperature=0.5, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                          presence_penalty=0.1, frequency_penalty=0.1, logprobs=MAX_LOGPROBS, seed=seed,
                          max_tokens=1)


def profile_peak_activation_bytes(runner: ModelRunner, config: EngineConfig,
                                  memory_stats: MemoryMeter | None = None) -> int:
    """Run one step of `largest_batch(config)` fresh prompts, each sampling a token, and return
    the bytes allocated at its peak above those held before it (0 without a meter: the step is
    then only a warm-up). The runner is left as it was: no dummy requests, no KV cache bound."""
    sizes = largest_batch(config)
    request_ids = [f"{PROFILE_REQUEST_PREFIX}{i}" for i in range(len(sizes))]
    new_reqs = []
    next_block = 0
    for i, (request_id, n) in enumerate(zip(request_ids, sizes, strict=True)):
        num_blocks = -(-n // runner.block_size)
        # Token 0 everywhere: any id does, and a fixed one never arms a prompt-triggered test fault.
        new_reqs.append(NewRequestData(request_id, token_ids=[0] * n, num_prompt_tokens=n,
                                       sampling_params=_worst_case_params(i),
                                       block_ids=list(range(next_block, next_block + num_blocks)),
                                       num_computed_tokens=0))
        next_block += num_blocks
    step = SchedulerOutput(new_reqs, [], dict(zip(request_ids, sizes, strict=True)), sum(sizes))
    _bind_kv_cache(runner, next_block)
    try:
        before = 0
        if memory_stats is not None:
            memory_stats.reset_peak()
            before = memory_stats.allocated()
        runner.execute(step)
        peak = memory_stats.peak() - before if memory_stats is not None else 0
    finally:
        runner.execute(SchedulerOutput([], [], {}, 0, finished_req_ids=set(request_ids)))
        _unbind_kv_cache(runner)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return peak


def _bind_kv_cache(runner: ModelRunner, num_blocks: int) -> None:
    """A cache of num_blocks per layer, bound as ModelRunner.initialize_kv_cache binds the real one
    (without its CUDA-graph capture). The layers get a fresh backend of the runner's kind, so any
    per-cache state a backend keeps goes away with it."""
    backend = type(runner.attention_backend)(runner.attention_backend.kv_quant)
    dtype = runner.kv_tensor_dtype
    runner.kv_caches = []
    for attn in runner.model.attention_layers():
        shape = layer_cache_shape(attn, backend, num_blocks, runner.block_size)
        attn.kv_cache = torch.zeros(shape, dtype=dtype, device=runner.device)
        attn.backend = backend
        if not has_own_cache_layout(attn):
            runner.kv_caches.append(attn.kv_cache)


def _unbind_kv_cache(runner: ModelRunner) -> None:
    for attn in runner.model.attention_layers():
        attn.kv_cache = None
        attn.backend = None
    runner.kv_caches = []
