"""ModelRunner: SchedulerOutput -> flat tensors -> model -> sampler -> ModelRunnerOutput.

It keeps each running request's tokens, block table and sampling parameters in a persistent input
batch (worker/input_batch.py: new requests arrive in full, running ones as diffs) and makes no
policy decisions: it computes exactly what it is told.
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import torch

from kvtide.attention.backend import AttentionMetadata
from kvtide.attention.registry import get_attention_backend
from kvtide.config import EngineConfig
from kvtide.distributed import get_pp_group, get_tp_group
from kvtide.kv_cache.hybrid import num_slots, stage_slots
from kvtide.kv_compression.formats import KVQuantFormat, kv_bytes_per_token, resolve_kv_cache_dtype
from kvtide.kv_compression.policy import apply_attention_window
from kvtide.layers.quantization import weight_bytes
from kvtide.models.cache_dir import check_triton_cache
from kvtide.models.loader import load_model
from kvtide.models.registry import architecture_name, describe_model_impl
from kvtide.sampling.ops import compute_top_logprobs
from kvtide.sampling.sampler import Sampler
from kvtide.sampling_params import SamplingParams
from kvtide.scheduler.output import ModelRunnerOutput, SchedulerOutput, TopLogprobs
from kvtide.testing.faults import FAULTS  # test-only fault injection, None unless KVTIDE_FAULT_INJECT is set
from kvtide.worker.cpu_allocator import collapse_in_background, keep_large_allocations_on_heap
from kvtide.worker.cpu_kernels import use_cpu_kernels
from kvtide.worker.cuda_graph import DecodeCudaGraphs, maybe_capture_decode_graphs, run_model
from kvtide.worker.input_batch import CachedRequestState, InputBatch, StepInputs, prepare_step_inputs

logger = logging.getLogger(__name__)


def _prebuild_cpu_kernels(attention: bool, quantized: bool) -> None:
    """The compiled CPU libraries this runner will load, built side by side while the model loads
    (on a cold cache; on a warm one they only load)."""
    from kvtide.attention import cpu_extension
    from kvtide.layers import layer_ops
    from kvtide.layers.quantization import cpu_kernels

    layer_ops.prebuild()
    if attention:
        cpu_extension.prebuild_attention()
    if quantized:
        cpu_kernels.prebuild()


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        self.config = config
        self.model_dir = model_dir
        mc = config.model_config
        self.device = torch.device(config.device_config.device)
        self.block_size = config.cache_config.block_size
        if self.device.type == "cpu":
            _prebuild_cpu_kernels(config.device_config.attention_backend == "cpu", mc.quant_config is not None)
        elif self.device.type == "cuda":  # Triton loads the kernels it compiled from its cache: ours alone, or refused
            check_triton_cache()
        self.model = load_model(model_dir, mc.hf_config, mc.dtype, mc.max_model_len, str(self.device),
                                mc.quant_config, mc.model_impl, mc.trust_remote_code)
        logger.info("model: %s, implementation: %s", architecture_name(mc.hf_config), describe_model_impl(mc.model_impl))
        self.vocab_size = mc.hf_config.vocab_size
        # ---- KV cache format: a float dtype or a quantized layout every backend reads
        cache_dtype = resolve_kv_cache_dtype(config.cache_config.kv_cache_dtype, mc.dtype)
        self.kv_cache_format = cache_dtype
        kv_quant = cache_dtype if isinstance(cache_dtype, KVQuantFormat) else None
        self.kv_tensor_dtype = torch.uint8 if kv_quant is not None else cache_dtype
        """The dtype of the cache tensors (uint8: a quantized format's bytes)."""
        self.attention_backend = get_attention_backend(config.device_config.attention_backend, kv_quant)
        self.sampler = Sampler(mc.seed)
        self.input_batch = InputBatch(self.block_size, self.vocab_size, self.device,
                                      config.scheduler_config.max_num_seqs, mc.max_model_len)
        self.requests: dict[str, CachedRequestState] = self.input_batch.requests
        """The input batch's request records, by request id (read by the draft proposers)."""
        self.samples = get_pp_group().is_last_rank
        """Whether this rank samples (the last pipeline stage); earlier stages take the sampled
        tokens from the scheduler output (CachedRequestData.sampled_token_ids)."""
        self._uids = itertools.count(1)
        self.logits_processors = None
        """The engine's logits processors (logits_processors/batch.py), told of every row change."""
        if config.logits_processors and self.samples:
            from kvtide.logits_processors.batch import LogitsProcessorBatch
            from kvtide.logits_processors.loader import build_processors

            self.logits_processors = LogitsProcessorBatch(
                build_processors(config.logits_processors, config, self.device))
            self.input_batch.row_listener = self.logits_processors
        self.kv_caches: list[torch.Tensor] = []
        """Caches in the attention backend's layout."""
        self._kv_to_collapse: list[torch.Tensor] = []
        """The KV pool on CPU, handed to cpu_allocator.collapse_in_background after the first step."""
        self.kv_groups = config.cache_config.kv_cache_groups
        """Layer groups with block tables of their own (kv_cache/hybrid.py), or None."""
        self.num_kv_groups = 1
        """Tables interleaved in each request's block ids: len(kv_groups) once the cache is bound."""
        self._own_layout_caches: list[tuple[torch.nn.Module, torch.Tensor]] = []
        """(layer, cache) of layers with a layout of their own (MLA's latent cache)."""
        if getattr(mc.quant_config, "needs_calibration", False):
            self._calibrate_quantization(model_dir)
        self.weight_bytes = weight_bytes(self.model)
        """Bytes the model's weights take as held (quantized tensors at their size)."""
        logger.info("model weights: %.1f MiB (%s)", self.weight_bytes / 2**20,
                    mc.quant_config.describe() if mc.quant_config is not None else str(mc.dtype).removeprefix("torch."))
        # ---- accelerator hook: fused Triton layers on CUDA; decode graphs after KV init
        if self.device.type == "cuda" and config.device_config.attention_backend == "triton":
            from kvtide.layers.triton_ops import use_triton_ops

            use_triton_ops(self.model)
            for _, moe in moe_layers(self.model):  # the grouped-GEMM MoE kernel (layers/moe/triton_moe.py)
                moe.use_triton = True
        self.cuda_graphs: DecodeCudaGraphs | None = None
        if self.device.type == "cpu":
            keep_large_allocations_on_heap()
            use_cpu_kernels(self.model, config.device_config.cpu_weight_prepack)
        self.after_weights_derived: list = []
        """Called after worker/sleep_mode.py derives packed and fused layouts from new weights."""
        # ---- LoRA hook: slot tensors and a forward hook on every adaptable linear (lora/)
        self.lora = None
        if config.lora_config is not None:
            from kvtide.lora.model_state import LoRAModelState

            self.lora = LoRAModelState(self.model, config.lora_config, mc.dtype, self.device)
            self.after_weights_derived.append(self.lora.weights_derived_again)
            # CUDA graphs replay the linears without their hooks (the fused CPU decode layers
            # likewise: LoRAModelState lets them run only steps without adapter rows).
            self.model.cuda_graph_blocker = "LoRA adapters: each step's rows choose their adapters"
        # ---- speculative decoding hook: proposes before the forward pass, verifies after it
        self.spec = None
        if config.speculative_config is not None:
            from kvtide.spec_decode.worker import SpecDecodeWorker

            self.spec = SpecDecodeWorker(config, self.model, self.device)
        apply_attention_window(self._cached_attention_layers(), config.cache_config)
        self.kv_connector = None
        """A KV connector's worker half (disagg/base.py), set once the caches exist, or None."""
        self.moe_layers = moe_layers(self.model)
        """(decoder layer index, FusedMoE) of each sparse layer: their expert load is reported per step."""
        for _, moe in self.moe_layers:
            moe.capacity_factor = mc.moe_capacity_factor
        # ---- pooling hook: a pooling model pools its prompts' hidden states instead of sampling
        self.pooling = None
        if mc.pooler_config is not None:
            from kvtide.pooling.runner import PoolingRunner

            self.pooling = PoolingRunner(self.model, mc.pooler_config)

    def _calibrate_quantization(self, model_dir: str) -> None:
        """Run the float model over the calibration text with its quantization's observers, then
        quantize (w8a8's SmoothQuant factors); the calibration's KV cache is freed after."""
        from kvtide.layers.quantization import finish_quantization
        from kvtide.layers.quantization.w8a8 import CALIBRATION_TOKENS, calibrate
        from kvtide.tokenizer import load_tokenizer

        mc = self.config.model_config
        tokenizer = load_tokenizer(mc.tokenizer or model_dir, mc.trust_remote_code)
        num_blocks = -(-min(CALIBRATION_TOKENS, mc.max_model_len) // self.block_size)
        self._bind_kv_caches(self.model.attention_layers(), num_blocks)
        calibrate(self, mc.quant_config.calibration_data, tokenizer, mc.max_model_len)
        for attn in self.model.attention_layers():
            attn.kv_cache = None
        with torch.device(self.device):
            finish_quantization(self.model)

    @torch.inference_mode()
    def prefill_hidden_states(self, token_ids: list[int]) -> torch.Tensor:
        """One sequence as one prefill through the model into blocks 0.. of the bound KV cache:
        its hidden states (T, hidden). For load-time calibration and quality measurements, outside
        the scheduler (nothing else may be using the cache)."""
        blocks = list(range(-(-len(token_ids) // self.block_size) * self.num_kv_groups))
        state = CachedRequestState("prefill", list(token_ids), len(token_ids), SamplingParams(), blocks, 0,
                                   uid=next(self._uids))
        inputs = prepare_step_inputs({"prefill": len(token_ids)}, {"prefill": state}, self.block_size, self.device,
                                     num_kv_groups=self.num_kv_groups)
        return self.model(inputs.input_ids, inputs.positions, inputs.metadata)

    # ---- KV cache ----------------------------------------------------------------------------
    def _cached_attention_layers(self) -> list:
        """Every attention layer given a KV cache: the target's, then a draft model's."""
        return self.model.attention_layers() + (self.spec.attention_layers() if self.spec else [])

    def kv_bytes_per_block(self) -> int:
        """Bytes one block takes over every cached layer, in the cache's format (parameters of a
        quantized one included), so a byte budget holds as many more tokens as the format saves.
        With layer groups a block holds one group's layers, as many as this stage has of one group
        (kv_cache/hybrid.py stage_slots; pipeline stages differ, the executor sizes by the largest)."""
        per_layer = [a.kv_bytes_per_token(self.kv_tensor_dtype) if has_own_cache_layout(a)
                     else kv_bytes_per_token(self.kv_cache_format, a.num_kv_heads, a.head_dim)
                     for a in self._cached_attention_layers()]
        if self.kv_groups:
            return self.block_size * num_slots(self._group_slots()) * max(per_layer)
        if not per_layer:  # an encoder keeps no paged cache: a block stands for its tokens' hidden states
            mc = self.config.model_config
            return self.block_size * mc.hf_config.hidden_size * mc.dtype.itemsize
        return self.block_size * sum(per_layer)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate each layer's cache in the backend's layout (zeroed: masked slots must hold
        finite values) and bind it to the layer."""
        layers = self._cached_attention_layers()
        self.num_kv_blocks = num_blocks
        if self.kv_groups:
            self.kv_caches = self._bind_grouped_kv_caches(layers, num_blocks)
        else:
            self.kv_caches = self._bind_kv_caches(layers, num_blocks)
        if self.device.type == "cpu":  # onto huge pages after the first step: start-up does not wait
            self._kv_to_collapse = list({id(a.kv_cache): a.kv_cache for a in layers}.values())
        self.cuda_graphs = maybe_capture_decode_graphs(self.model, self.config, self.device)
        if self.spec is not None:
            self.spec.capture_graphs(self.config)
        for attn in layers:  # after capture: the first real pass sets the scales (graphs read them in place)
            attn.calculate_kv_scales = self.config.cache_config.calculate_kv_scales
        self.take_expert_load()  # what load-time passes (profiling, capture) routed is not served load

    def _bind_kv_caches(self, layers: list, num_blocks: int) -> list[torch.Tensor]:
        """A layer with a cache layout of its own (`cache_shape`: MLA's latent cache) gets that;
        every other layer the backend's."""
        caches = []
        self._own_layout_caches = []
        for attn in layers:
            shape = layer_cache_shape(attn, self.attention_backend, num_blocks, self.block_size)
            attn.kv_cache = torch.zeros(shape, dtype=self.kv_tensor_dtype, device=self.device)
            attn.backend = self.attention_backend
            if has_own_cache_layout(attn):
                self._own_layout_caches.append((attn, attn.kv_cache))
            else:
                caches.append(attn.kv_cache)
        return caches

    def _bind_grouped_kv_caches(self, layers: list, num_blocks: int) -> list[torch.Tensor]:
        """Layer groups (kv_cache/hybrid.py): slot tensors for this stage's layers, the j-th of a
        group's layers here bound to slot j (S slots at world size 1); a block id belongs to one
        group at a time, so the layers sharing a slot never share a block."""
        slots_of = self._group_slots()
        start = getattr(self.model, "start_layer", 0)
        assert sorted(slots_of) == list(range(start, start + len(layers))), "groups must cover the layers"
        shapes = {layer_cache_shape(a, self.attention_backend, num_blocks, self.block_size) for a in layers}
        assert len(shapes) == 1 and not any(has_own_cache_layout(a) for a in layers), \
            "layer groups need one cache shape in every layer"
        shape = shapes.pop()
        slots = [torch.zeros(shape, dtype=self.kv_tensor_dtype, device=self.device)
                 for _ in range(num_slots(slots_of))]
        for i, attn in enumerate(layers):
            g, j = slots_of[start + i]
            attn.kv_cache = slots[j]
            attn.backend = self.attention_backend
            attn.kv_group = g
        self.num_kv_groups = len(self.kv_groups)
        return slots

    def _group_slots(self) -> dict[int, tuple[int, int]]:
        """This rank's decoder layers (its pipeline stage's) -> (layer group, slot tensor)."""
        start = getattr(self.model, "start_layer", 0)
        return stage_slots(self.kv_groups, range(start, start + len(self.model.attention_layers())))

    def kv_block_io(self):
        """Whole-block access to every cached layer, for a KV connector (disagg/block_io.py)."""
        from kvtide.disagg.block_io import KVBlockIO

        layers = self._cached_attention_layers()
        shapes = [lambda n, a=a: layer_cache_shape(a, self.attention_backend, n, self.block_size) for a in layers]
        return KVBlockIO([a.kv_cache for a in layers], shapes,
                         f"{self.attention_backend.name}|{self.kv_cache_format}|{self.block_size}")

    # ---- the step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        connector = self.kv_connector
        if connector is not None:  # before copy-on-write: an evicted block may be a copy's target
            connector.start_load_kv(so.kv_connector_metadata)
        if so.block_copies:  # copy-on-write of blocks shared after a fork, before anything writes
            src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*so.block_copies, strict=True))
            for cache in self.kv_caches:
                self.attention_backend.copy_blocks(cache, src, dst)
            for attn, cache in self._own_layout_caches:
                attn.copy_blocks(cache, src, dst)
        if so.is_empty:
            return ModelRunnerOutput(sampled_token_ids={}, kv_connector_output=connector.save_kv(
                so.kv_connector_metadata) if connector is not None else None)
        drafts = self.spec.propose(so, self.requests) if self.spec is not None and so.num_draft_tokens else {}
        if so.grammar is not None and drafts:  # structured output: drafts the grammar forbids are cut
            drafts = so.grammar.check_drafts(drafts, keep=self.spec.sampled_draft_ids(drafts))
        if self.spec is not None and so.num_draft_tokens:  # every rank of the TP group computes rank 0's
            drafts = self.spec.agree(so, drafts)
        inputs = self._prepare_inputs(so, drafts)
        mass = self._score_accumulator(inputs.metadata)
        lora_failed: dict[int, str] = {}
        if self.lora is not None:
            lora_failed = self.lora.begin_step(self.input_batch.step_lora_requests(inputs),
                                               np.diff(inputs.metadata.query_start_loc_cpu))
        try:
            hidden = self._forward(inputs)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        if self._kv_to_collapse:  # the first forward pass is done: start-up never waits for this
            collapse_in_background(self._kv_to_collapse)
            self._kv_to_collapse = []
        output = ModelRunnerOutput(sampled_token_ids={}, expert_load=self.take_expert_load())
        for index, error in lora_failed.items():  # their rows ran as the base model: they end here
            output.failed[inputs.order[index]] = error
        if connector is not None:
            output.kv_connector_output = connector.save_kv(so.kv_connector_metadata)
        if hidden is None:  # a pipeline stage before the last: the tokens it samples come with later steps
            return output
        if self.pooling is not None:
            return self._pool(so, inputs, hidden, output)
        if mass is not None:
            get_tp_group().all_reduce(mass)  # each TP rank's heads' share (a no-op at tp 1)
            output.kv_block_mass = {req_id: mass[i, :-(-inputs.metadata.seq_lens_cpu[i] // self.block_size)].tolist()
                                    for i, req_id in enumerate(inputs.order)}
        self._prompt_logprobs(so, inputs, hidden, output)
        if self.spec is not None:
            emitted = self._verify(so, inputs, hidden, drafts, output) if inputs.sample_rows else {}
            self.spec.observe(inputs, hidden, self.requests, drafts, emitted)
        elif inputs.sample_rows:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            self._apply_grammar(so, inputs, logits, drafts)
            states, md = self.input_batch.sampling_metadata(inputs)
            if self.logits_processors is not None:
                md.logits_processors = self.logits_processors.step(states)
            if FAULTS is not None:  # fault injection for the reliability tests (kvtide/testing/faults.py)
                FAULTS.on_logits(logits, [s.token_ids[:s.num_prompt_tokens] for s in states])
            sampled = self.sampler(logits, md)
            tokens = sampled.token_ids
            for row in sampled.bad_rows:
                output.failed[states[row].request_id] = "model produced non-finite logits"
                tokens[row] = 0  # an input for a step scheduled ahead; its output is dropped
            bad = set(sampled.bad_rows)
            for row, (state, token) in enumerate(zip(states, tokens, strict=True)):
                if row in bad:
                    continue
                output.sampled_token_ids[state.request_id] = token
                if sampled.logprobs[row] is not None:
                    output.logprobs[state.request_id] = sampled.logprobs[row]  # type: ignore[assignment]
            rows = inputs.batch_rows[inputs.sample_rows]  # type: ignore[index]
            self.input_batch.append_sampled(rows, states, tokens)
            received = receive_sampled_tokens(states)
            if received is not None:
                self.input_batch.set_last_tokens(rows, states, received)
        return output

    def _forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """The step's forward pass. Under pipeline parallelism a stage after the first receives the
        previous stage's (hidden states, residual) and a stage before the last sends its own on and
        returns None; tensor-parallel ranks of one stage send and receive alike (their activations
        are identical after each all-reduce). The score drop policy's attention mass travels the
        same way, after the activations: each stage adds its layers to the running sum, in layer
        order as at world size 1, and the last holds every layer's."""
        pp = get_pp_group()
        if pp.world_size == 1:
            return run_model(self.model, self.cuda_graphs, inputs.input_ids, inputs.positions, inputs.metadata)
        intermediate = None
        if not pp.is_first_rank:
            hidden_size = self.config.model_config.hf_config.hidden_size
            received = torch.empty(2, inputs.input_ids.shape[0], hidden_size, dtype=self.config.model_config.dtype,
                                   device=self.device)
            pp.recv(received, pp.rank_in_group - 1)
            intermediate = (received[0], received[1])
        mass = inputs.metadata.attention_mass
        if mass is not None and not pp.is_first_rank:
            pp.recv(mass, pp.rank_in_group - 1)
        out = self.model(inputs.input_ids, inputs.positions, inputs.metadata, intermediate=intermediate)
        if pp.is_last_rank:
            return out
        pp.send(torch.stack(out), pp.rank_in_group + 1)
        if mass is not None:
            pp.send(mass, pp.rank_in_group + 1)
        return None

    def take_expert_load(self) -> dict | None:
        """Assignments each expert of each sparse layer took since the last call, and those the
        capacity cap skipped: {"layers", "tokens", "dropped"} (engine/expert_load.py); None for a
        dense model."""
        if not self.moe_layers:
            return None
        tokens, dropped = zip(*(moe.take_expert_load() for _, moe in self.moe_layers), strict=True)
        return {"layers": [i for i, _ in self.moe_layers], "tokens": torch.stack(tokens).tolist(),
                "dropped": torch.stack(dropped).tolist()}

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """Experts shared across data-parallel replicas, and nothing to run here this step while
        another replica runs: every MoE layer still enters its exchanges, in forward order, with no
        tokens (no attention, no KV cache, no sampling), so the others' all-to-alls complete."""
        dtype = self.config.model_config.dtype
        for _, moe in self.moe_layers:
            moe.forward(torch.empty(0, moe.hidden_size, dtype=dtype, device=self.device),
                        torch.empty(0, moe.num_experts, dtype=torch.float32, device=self.device))

    def _score_accumulator(self, md: AttentionMetadata) -> torch.Tensor | None:
        """The score drop policy's per-step attention mass, (num_reqs, max_blocks), which every
        attention layer adds to (kv_compression/score_dropping.py); None without the policy."""
        if self.config.cache_config.kv_drop_policy is None:
            return None
        mass = torch.zeros(md.block_tables.shape, dtype=torch.float32, device=self.device)
        md.attention_mass = mass
        return mass

    @staticmethod
    def _apply_grammar(so: SchedulerOutput, inputs: StepInputs, logits: torch.Tensor,
                       drafts: dict[str, list[int]]) -> None:
        """Structured output: mask the constrained rows' logits in place (after the forward pass
        was launched, so on CUDA the masks are filled while it runs)."""
        if so.grammar is not None:
            so.grammar.apply(logits, [(inputs.order[i], len(drafts.get(inputs.order[i], ())) + 1)
                                      for i in inputs.sample_rows])

    def _verify(self, so: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor,
                drafts: dict[str, list[int]], output: ModelRunnerOutput) -> dict[str, list[int]]:
        """Sampling with speculative decoding: every sampling row through the verifier (a row
        without drafts is an ordinary sample). Returns each row's emitted tokens."""
        assert self.spec is not None
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        self._apply_grammar(so, inputs, logits, drafts)
        states = [self.requests[inputs.order[i]] for i in inputs.sample_rows]
        emitted = self.spec.verify(self.sampler, logits, states, drafts, self.vocab_size, output)
        for state in states:  # a failed row gets a 0: an input for nothing
            self.input_batch.append_tokens(state.request_id, emitted[state.request_id] or [0])
        return emitted

    def _pool(self, so: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor,
              output: ModelRunnerOutput) -> ModelRunnerOutput:
        """Pooling models: the requests whose prompt ends here get their pooled output (and end)."""
        states = [self.requests[req_id] for req_id in inputs.order]
        output.pooler_output = self.pooling.pool(  # type: ignore[union-attr]
            inputs.order, list(inputs.metadata.query_start_loc_cpu), hidden,
            [s.num_computed_tokens for s in states], [s.num_prompt_tokens for s in states],
            [s.pooling_params for s in states])
        return output

    def _update_states(self, so: SchedulerOutput) -> None:
        if self.pooling is not None:  # a request sent in full (again) pools its prompt from the start
            self.pooling.forget(so.finished_req_ids | {r.request_id for r in so.scheduled_new_reqs})
        self.input_batch.update(so, self._uids, self.samples)
        if self.spec is not None and so.finished_req_ids:
            self.spec.forget(so.finished_req_ids)

    def _prepare_inputs(self, so: SchedulerOutput, drafts: dict[str, list[int]]) -> StepInputs:
        num_sched = so.num_scheduled_tokens
        if so.num_draft_tokens:  # draft slots the proposer left empty are not computed
            num_sched = dict(num_sched)
            for req_id, slots in so.num_draft_tokens.items():
                num_sched[req_id] -= slots - len(drafts.get(req_id, ()))
        return self.input_batch.prepare(num_sched, drafts, self.num_kv_groups)

    def _prompt_logprobs(self, so: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor,
                         output: ModelRunnerOutput) -> None:
        """Logprobs of prompt tokens 1..P-1 whose predicting positions are computed this step."""
        for i, req_id in enumerate(inputs.order):
            state = self.requests[req_id]
            k = state.sampling_params.prompt_logprobs
            start = state.num_computed_tokens
            end = min(start + so.num_scheduled_tokens[req_id], state.num_prompt_tokens - 1)
            if k is None or start >= end:
                continue
            offset = inputs.metadata.query_start_loc_cpu[i]
            logprobs = self.model.compute_logits(hidden[offset:offset + end - start]).log_softmax(dim=-1)
            entries: list[TopLogprobs] = []
            for j, pos in enumerate(range(start, end)):
                entries.append(compute_top_logprobs(logprobs[j], state.token_ids[pos + 1], k))
            output.prompt_logprobs[req_id] = entries


def receive_sampled_tokens(states: list[CachedRequestState]) -> list[int] | None:
    """The tensor-parallel ranks of the sampling stage all sample from the same all-gathered
    logits, but under tensor parallelism alone only the first applies structured output's masks
    (the matchers live beside it; under pipeline parallelism every rank gets them computed ahead):
    it broadcasts its tokens (each state's last) and the others return them, to overwrite their
    last tokens with. None without tensor parallelism and on the first rank. (Earlier pipeline
    stages get the tokens with the requests' next step: CachedRequestData.sampled_token_ids.)"""
    tp = get_tp_group()
    if tp.world_size == 1 or not states:
        return None
    tokens = torch.tensor([s.token_ids[-1] for s in states], dtype=torch.int64)
    tp.broadcast(tokens, 0)
    return None if tp.is_first_rank else tokens.tolist()


def has_own_cache_layout(attn) -> bool:
    """Whether an attention layer lays out its cache itself (`cache_shape`: MLA's latent cache)."""
    return hasattr(attn, "cache_shape")


def layer_cache_shape(attn, backend, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """One layer's cache shape: its own layout, or the attention backend's."""
    if has_own_cache_layout(attn):
        return attn.cache_shape(num_blocks, block_size)
    return backend.kv_cache_shape(num_blocks, block_size, attn.num_kv_heads, attn.head_dim)


def moe_layers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, FusedMoE) for each sparse layer of `model`."""
    from kvtide.layers.moe import FusedMoE

    return [(i, m) for i, layer in enumerate(getattr(model, "layers", ())) for m in layer.modules()
            if isinstance(m, FusedMoE)]


