"""Engine configuration: small frozen area configs, each field with a default and a docstring.

The CLI builds its flags from `EngineArgs` (same names as vLLM's), so the help text and the
defaults live in one place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine and scheduler read these configs without loading torch
    import torch

_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}
"""--dtype names -> the torch dtype (its attribute name) each stands for."""

def resolve_dtype(dtype: str | torch.dtype, config_dtype: torch.dtype | None, device: str) -> torch.dtype:
    """'auto' means float32 on CPU (bf16 matmuls are slow without AMX) and the checkpoint's dtype on GPU."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, config_dtype, None)
    if dtype == "auto":
        if device == "cpu":
            return torch.float32
        return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return getattr(torch, _DTYPES[dtype])


def _float32() -> torch.dtype:
    import torch

    return torch.float32


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how to run it."""

    model: str
    """Local directory or Hugging Face hub id of the checkpoint ('demo' builds a tiny local one)."""
    tokenizer: str | None = None
    """Tokenizer directory or hub id; defaults to `model`."""
    dtype: torch.dtype = field(default_factory=_float32)
    """Resolved parameter and activation dtype."""
    max_model_len: int = 2048
    """Longest sequence (prompt + output) a request may reach."""
    seed: int = 0
    """Seed for the random state of unseeded sampling."""
    trust_remote_code: bool = False
    """Never execute code shipped with a checkpoint unless set."""
    revision: str | None = None
    """Hub revision (branch, tag or commit)."""
    hf_config: Any = None
    """The transformers PretrainedConfig the model is built from."""
    quant_config: Any = None
    """The weight quantization the model loads with (layers/quantization/); None: float weights."""
    moe_capacity_factor: float | None = None
    """MoE models: tokens per expert per step capped at this times the even share; None: no cap."""
    model_impl: str = "kvtide"
    """The implementation that runs the model, as --model-impl resolved it: "kvtide" (kvtide's own
    module) or "transformers" (Hugging Face's modeling code with kvtide's paged attention)."""
    enable_sleep_mode: bool = False
    """Whether sleep() / wake_up() and weight updates are allowed (worker/sleep_mode.py)."""
    pooler_config: Any = None
    """A pooling model's PoolerConfig (kvtide/pooling/config.py: embed or classify, pooling type,
    normalization); None: a generation model."""


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int = 0
    """Blocks in the pool (per layer); computed from kv_cache_memory."""
    kv_cache_memory: int | None = None
    """Bytes for the KV cache across all layers; None: gpu_memory_utilization on GPU, 2GiB on CPU."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use (weights + activations + KV cache)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks whose token prefix was computed before."""
    prefix_caching_hash_algo: str = "sha256"
    """Hash for prefix-cache block keys: sha256 or xxh128 (both collision resistant for this use)."""
    kv_cache_dtype: str = "auto"
    """How K/V are stored (kv_compression/formats.py): auto (the model's dtype), float32, bfloat16,
    float16, fp8 (= fp8_e4m3), fp8_e5m2, int8 or k8v4 (int8 K, int4 V)."""
    calculate_kv_scales: bool = False
    """fp8 caches: set each layer's per-tensor K/V scales from the first forward pass's K/V."""
    sliding_window: int | None = None
    """The window every attention layer attends within (the model's own, or kv_window_tokens), when
    all layers have one: blocks wholly before it are returned to the pool as a request grows."""
    kv_sink_tokens: int = 0
    """With kv_window_tokens: the first tokens every query keeps seeing (StreamingLLM's sinks)."""
    kv_window_tokens: int | None = None
    """Attend only the sinks and the last kv_window_tokens tokens (all layers); None: off."""
    kv_drop_policy: str | None = None
    """'score': drop the KV blocks with the least accumulated attention (kv_compression/score_dropping.py)."""
    kv_drop_budget: float | None = None
    """Fraction of a request's full KV blocks the score policy keeps."""
    kv_cache_groups: tuple | None = None
    """Models mixing full and windowed attention layers: the layer groups (kv_cache/hybrid.py
    KVCacheGroup), each with a block table of its own; None: one table per request."""


@dataclass(frozen=True)
class SchedulerConfig:
    """The token-budget scheduler."""

    max_num_seqs: int = 256
    """Most requests running in one step."""
    max_num_batched_tokens: int = 8192
    """Most tokens (prefill chunks + decodes) computed in one step."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so decodes keep flowing."""
    policy: str = "fcfs"
    """'fcfs' (arrival order) or 'priority' (lower value first, then arrival)."""
    max_waiting_requests: int | None = None
    """Bound on queued requests; beyond it new requests are refused (server: 429)."""
    async_scheduling: bool = False
    """Schedule step N+1 and process step N's outputs while step N runs (engine/core.py)."""


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"
    """'cpu' or 'cuda'."""
    attention_backend: str = "torch"
    """'cpu' (compiled CPU kernels), 'torch' (pure torch, any device), 'torch_ref' (the oracle) or
    'triton' (GPU kernels)."""
    enforce_eager: bool = False
    """Never capture or replay CUDA graphs (decode steps run eagerly)."""
    cpu_weight_prepack: str = "auto"
    """'auto', 'on' or 'off': float32 CPU linears on the GEMM kernel measured fastest (layers/cpu_gemm.py)."""


@dataclass(frozen=True)
class ParallelConfig:
    """How one engine replica spreads over processes, and how many replicas serve (vLLM's names)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    """Engine replicas (each tensor_parallel_size x pipeline_parallel_size ranks) behind one API server."""
    data_parallel_size_local: int | None = None
    """Replicas started on this node (default: all of them)."""
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int | None = None
    enable_expert_parallel: bool = False
    """MoE layers: each rank of the TP group owns whole experts instead of a slice of every one."""
    distributed_executor_backend: str = "uni"
    """'uni' (one process), 'mp' (one worker process per extra rank on this node) or 'ray'."""
    cpu_threads_per_rank: int | None = None
    """torch threads of each rank on CPU (None: the usable cores split evenly)."""

    @property
    def world_size(self) -> int:
        """Ranks of one replica."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Constrained decoding (structured_output/)."""

    backend: str = "xgrammar"
    """The grammar engine ('auto' means xgrammar, the only one built in)."""
    enable_jump_forward: bool = True
    """Append the tokens a grammar forces (keys, punctuation, fixed strings) without sampling
    each; requests that ask for logprobs are always decoded token by token."""
    max_whitespace_cnt: int | None = 16
    """The longest run of optional whitespace JSON output may hold (xgrammar's bound; null:
    unbounded). Without it a model that likes whitespace fills max_tokens with it and never closes
    the object; 16 still fits a newline and the indentation of pretty-printed JSON 4 levels deep."""
    compile_workers: int = 2
    """Grammar compiler processes (started as needed): a slow compile holds one, not all."""
    compile_timeout_s: float = 30.0
    """Wall time one grammar may compile for; past it the compile is killed and its requests fail."""
    compile_memory_limit: int | str = 1 << 30
    """Memory one compile may take beyond its process's start-up footprint (bytes or '1GiB');
    past it the compile fails and its process is replaced."""
    cache_bytes: int | str = 256 << 20
    """Compiled grammars kept for reuse, in bytes (least recently used dropped first)."""

    @classmethod
    def parse(cls, value: str | dict | None) -> StructuredOutputsConfig:
        """From --structured-outputs-config JSON (or a dict); ValueError naming a bad key."""
        import json

        if value is None:
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"structured_outputs_config: not valid JSON ({e})") from e
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs_config must be a JSON object, got {value!r}")
        unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"structured_outputs_config: unknown key(s) {sorted(unknown)}; known: "
                             f"{', '.join(f.name for f in dataclasses.fields(cls))}")
        config = cls(**value)
        if config.backend not in ("auto", "xgrammar"):
            raise ValueError(f"structured_outputs_config.backend must be 'xgrammar' or 'auto', got {config.backend!r}")
        if not isinstance(config.enable_jump_forward, bool):
            raise ValueError("structured_outputs_config.enable_jump_forward must be true or false")
        return config._checked_limits()

    def _checked_limits(self) -> StructuredOutputsConfig:
        """The compile limits checked, byte sizes as ints; ValueError naming the key."""
        from kvtide.sizes import parse_size

        def positive_int(name: str, value: object, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"structured_outputs_config.{name} must be an integer >= 1"
                                 f"{' or null' if allow_none else ''}, got {value!r}")

        positive_int("max_whitespace_cnt", self.max_whitespace_cnt, allow_none=True)
        positive_int("compile_workers", self.compile_workers)
        timeout = self.compile_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"structured_outputs_config.compile_timeout_s must be a number > 0, got {timeout!r}")
        return dataclasses.replace(
            self, compile_timeout_s=float(timeout),
            compile_memory_limit=parse_size(self.compile_memory_limit, "structured_outputs_config.compile_memory_limit"),
            cache_bytes=parse_size(self.cache_bytes, "structured_outputs_config.cache_bytes"))


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    speculative_config: Any = None
    """kvtide.spec_decode.config.SpeculativeConfig, or None: no speculative decoding."""
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer_config: Any = None
    """kvtide.disagg.config.KVTransferConfig, or None: the KV cache lives on the device only."""
    kv_events_config: Any = None
    """kvtide.kv_events.KVEventsConfig, or None: the block pool's changes are not published."""
    lora_config: Any = None
    """kvtide.lora.config.LoRAConfig, or None: no LoRA adapters."""
    logits_processors: tuple = ()
    """Logits-processor classes or their 'module:Class' names, built once per runner (logits_processors/)."""

    def replace_cache(self, **kwargs: Any) -> EngineConfig:
        return dataclasses.replace(self, cache_config=dataclasses.replace(self.cache_config, **kwargs))
