"""Tensor and pipeline parallelism against Hugging Face transformers: greedy tokens equal and
logprobs (sampled and prompt) within 1e-4, with chunked prefill, preemption and a warm prefix
cache, on real multi-process replicas (gloo on 127.0.0.1, one thread per rank).

TP=2 on GQA (4 query / 2 KV heads, one KV head per rank) and on MQA (1 KV head, replicated on both
ranks) with tied embeddings (vocabulary-parallel table shared by the LM head); PP=2 on Qwen2 (q/k/v
bias, tied embeddings: the last stage keeps its own copy of the table); TP=2 x PP=2 in 4 processes.

Mixture-of-experts and MLA models: experts split whole (expert parallel) or by their intermediate
dimension (tensor-parallel experts: 1/tp of every expert per rank, routed and shared experts
all-reduced once per block), DeepSeek's latent attention with its heads split and the whole latent
cache on every rank, and pipeline stages; the expert load equal to one rank's.
"""

from __future__ import annotations

import dataclasses

import pytest
from hf_reference import LONG_PROMPT, hf_greedy
from test_hf_parity import (
    ARCH_CASES,
    GREEDY_LOGPROBS,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    PROMPTS,
    assert_greedy_matches_hf,
    assert_logprobs_match_hf,
    assert_prompt_logprobs_match_hf,
    make_llm,
)
from test_moe_parity import MLA, moe_case_dir

from kvtide.layers.moe import FusedMoE

WARM = dataclasses.replace(GREEDY_LOGPROBS, prompt_logprobs=None)

CASES = {
    "tp2-gqa": ("llama-gqa", dict(tensor_parallel_size=2)),
    "tp2-mqa-replicated-kv-tied": ("llama-mqa-tied-theta", dict(tensor_parallel_size=2)),
    "pp2-qwen2-bias-tied": ("qwen2-bias-tied", dict(pipeline_parallel_size=2)),
    "tp2-pp2": ("llama-gqa", dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
}


def parallel_llm(model_dir: str, parallel: dict, **kwargs):
    return make_llm(model_dir, cpu_threads_per_rank=1, **parallel, **kwargs)


@pytest.mark.parametrize("case", list(CASES))
def test_parallel_replica_matches_hf(checkpoint_factory, case):
    arch_case, parallel = CASES[case]
    architecture, config = ARCH_CASES[arch_case]
    model_dir = checkpoint_factory(architecture, **config)
    probe = make_llm(model_dir, kv_cache_memory="1MiB")
    block_bytes = probe.engine.core.executor.kv_bytes_per_block()
    probe.shutdown()
    # A rank caches its KV heads (a replicated head counts whole) of its stage's layers; the
    # memory budget is per rank.
    tp, pp = parallel.get("tensor_parallel_size", 1), parallel.get("pipeline_parallel_size", 1)
    kv_heads = config.get("num_key_value_heads", 2)
    rank_block_bytes = block_bytes * max(1, kv_heads // tp) // kv_heads // pp
    num_blocks = -(-MAX_MODEL_LEN // 16) + 3  # room for the longest request and little else
    shared = [LONG_PROMPT[:200] + suffix for suffix in (" and then", "!")]
    prompts = PROMPTS + shared
    llm = parallel_llm(model_dir, parallel, kv_cache_memory=str(num_blocks * rank_block_bytes),
                       enable_prefix_caching=True, max_num_batched_tokens=48)
    try:
        assert llm.engine.core.executor.kv_bytes_per_block() == rank_block_bytes
        assert llm.engine.core.config.cache_config.num_blocks == num_blocks
        cold = llm.generate(prompts, GREEDY_LOGPROBS)
        scheduler = llm.engine.core.scheduler
        assert scheduler.num_preemptions > 0
        assert_greedy_matches_hf(model_dir, prompts, cold)
        for i, (prompt, out) in enumerate(zip(prompts, cold, strict=True)):
            assert_logprobs_match_hf(hf_greedy(model_dir, prompt, MAX_TOKENS), out, f"{case} prompt {i}")
            assert_prompt_logprobs_match_hf(model_dir, out, f"{case} prompt {i}")
        # one at a time: the second finds the first's blocks in the prefix cache (prompt logprobs
        # would recompute the prompt, so only the sampled tokens' are asked)
        warm = [llm.generate([prompt], WARM)[0] for prompt in shared]
        assert warm[1].num_cached_tokens >= 160
        assert_greedy_matches_hf(model_dir, shared, warm)
        for i, (prompt, out) in enumerate(zip(shared, warm, strict=True)):
            assert_logprobs_match_hf(hf_greedy(model_dir, prompt, MAX_TOKENS), out, f"{case} warm prompt {i}")
        scheduler.kv_cache_manager.pool.check_integrity()
        assert scheduler.kv_cache_manager.pool.num_used_blocks == 0
    finally:
        llm.shutdown()


TP2 = dict(tensor_parallel_size=2)
EP2 = dict(tensor_parallel_size=2, enable_expert_parallel=True)
MOE_CASES = {
    # case: (checkpoint: architecture and config overrides, or a case of test_moe_parity.py), parallel
    "mixtral-tp2-ep": (("MixtralForCausalLM", {}), EP2),
    "qwen2moe-tp2-ep-shared-expert": (("Qwen2MoeForCausalLM", {}), EP2),
    "mixtral-pp2": (("MixtralForCausalLM", {}), dict(pipeline_parallel_size=2)),
    # tensor-parallel experts: every rank half of each expert's intermediate dimension
    "mixtral-tp2-tp-experts": (("MixtralForCausalLM", {}), TP2),
    "qwen2moe-tp2-tp-experts-shared-expert": ("qwen2-moe", TP2),
    # MLA: 2 of the 4 heads per rank; q LoRA and tensor-parallel experts / no q LoRA and expert parallel
    "deepseek-v3-tp2-tp-experts": ("deepseek-v3", TP2),
    "deepseek-v2-tp2-ep": ("deepseek-v2", EP2),
    "deepseek-v3-pp2": ("deepseek-v3", dict(pipeline_parallel_size=2)),
}


def moe_checkpoint(checkpoint_factory, checkpoint) -> str:
    """A tiny MoE checkpoint: (architecture, overrides), or test_moe_parity's case by name (DeepSeek-V3's
    correction bias randomized there, so that routing depends on it)."""
    if not isinstance(checkpoint, str):
        architecture, overrides = checkpoint
        return checkpoint_factory(architecture, **overrides)
    return moe_case_dir(checkpoint_factory, checkpoint)


def expert_weight_bytes(model) -> int:
    return sum(m.w13_weight.nbytes + m.w2_weight.nbytes for m in model.modules() if isinstance(m, FusedMoE))


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_replica_matches_hf_and_counts_the_same_expert_load(checkpoint_factory, case):
    """Experts split whole over two ranks (tokens exchanged by all-to-all; the shared expert and
    attention tensor-parallel), split by their intermediate dimension (partial sums all-reduced),
    or layers over two stages: HF's tokens and logprobs, and the expert load the engine reports
    equal to one rank's. Tensor-parallel experts: rank 0 holds exactly 1/tp of the expert bytes,
    and a step costs one all-reduce per attention and per MoE block (routed and shared experts
    reduced together). MLA: each rank caches the whole latent (not divided by tp)."""
    checkpoint, parallel = MOE_CASES[case]
    model_dir = moe_checkpoint(checkpoint_factory, checkpoint)
    tp, pp = parallel.get("tensor_parallel_size", 1), parallel.get("pipeline_parallel_size", 1)
    tp_experts = tp > 1 and not parallel.get("enable_expert_parallel")
    prompts = PROMPTS[:4]
    whole = make_llm(model_dir, max_num_batched_tokens=48)
    whole.generate(prompts, GREEDY_LOGPROBS)
    expected_load = whole.engine.core.get_stats().expert_load
    whole_experts = expert_weight_bytes(whole.engine.core.executor.runner.model)
    whole_block_bytes = whole.engine.core.executor.kv_bytes_per_block()
    hf = whole.engine.core.config.model_config.hf_config
    whole.shutdown()
    llm = parallel_llm(model_dir, parallel, max_num_batched_tokens=48)
    try:
        executor = llm.engine.core.executor
        model = executor.runner.model
        if tp_experts:
            assert expert_weight_bytes(model) * tp == whole_experts
            assert len(set(executor.weight_bytes_per_rank)) == 1  # the ranks hold alike
        if getattr(hf, "kv_lora_rank", None):  # MLA: the whole latent per token and layer on every rank
            latent = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]
            block_bytes = 16 * (hf.num_hidden_layers // pp) * latent * 4
            assert executor.runner.kv_bytes_per_block() == executor.kv_bytes_per_block() == block_bytes
            assert block_bytes * pp == whole_block_bytes
            for attn in model.attention_layers():
                assert attn.num_heads == hf.num_attention_heads // tp and attn.kv_cache.shape[-1] == latent
        outputs = llm.generate(prompts, GREEDY_LOGPROBS)
        assert_greedy_matches_hf(model_dir, prompts, outputs)
        for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
            assert_logprobs_match_hf(hf_greedy(model_dir, prompt, MAX_TOKENS), out, f"{case} prompt {i}")
        load = llm.engine.core.get_stats().expert_load
        assert load["layers"] == expected_load["layers"]  # every sparse layer, of every stage
        assert load["tokens"] == expected_load["tokens"]
        if parallel.get("enable_expert_parallel"):
            stats = llm.engine.core.executor.comm_stats()
            assert all(stats[rank]["tp.all_to_all"]["bytes"] > 0 for rank in (0, 1))
        if tp_experts:  # one step: the embedding's all-reduce, then attention's and the MLP's per layer
            before = executor.comm_stats()
            llm.generate(prompts[:1], dataclasses.replace(WARM, max_tokens=1, logprobs=None))
            after = executor.comm_stats()
            for rank in range(tp):
                calls = {kind: after[rank].get(kind, {}).get("calls", 0) - before[rank].get(kind, {}).get("calls", 0)
                         for kind in ("tp.all_reduce", "tp.all_to_all")}
                assert calls == {"tp.all_reduce": 1 + 2 * hf.num_hidden_layers, "tp.all_to_all": 0}
    finally:
        llm.shutdown()
