"""Tensor and pipeline parallelism against Hugging Face transformers: greedy tokens equal and
logprobs (sampled and prompt) within 1e-4, with chunked prefill, preemption and a warm prefix
cache, on real multi-process replicas (gloo on 127.0.0.1, one thread per rank).

TP=2 on GQA (4 query / 2 KV heads, one KV head per rank) and on MQA (1 KV head, replicated on both
ranks) with tied embeddings (vocabulary-parallel table shared by the LM head); PP=2 on Qwen2 (q/k/v
bias, tied embeddings: the last stage keeps its own copy of the table); TP=2 x PP=2 in 4 processes.
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


MOE_CASES = {
    "mixtral-tp2-ep": ("MixtralForCausalLM", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    "qwen2moe-tp2-ep-shared-expert": ("Qwen2MoeForCausalLM", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    "mixtral-pp2": ("MixtralForCausalLM", dict(pipeline_parallel_size=2)),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_replica_matches_hf_and_counts_the_same_expert_load(checkpoint_factory, case):
    """Experts split whole over two ranks (tokens exchanged by all-to-all; the shared expert and
    attention tensor-parallel), or layers over two stages: HF's tokens and logprobs, and the
    expert load the engine reports equal to one rank's."""
    architecture, parallel = MOE_CASES[case]
    model_dir = checkpoint_factory(architecture)
    prompts = PROMPTS[:4]
    whole = make_llm(model_dir, max_num_batched_tokens=48)
    whole.generate(prompts, GREEDY_LOGPROBS)
    expected_load = whole.engine.core.get_stats().expert_load
    whole.shutdown()
    llm = parallel_llm(model_dir, parallel, max_num_batched_tokens=48)
    try:
        outputs = llm.generate(prompts, GREEDY_LOGPROBS)
        assert_greedy_matches_hf(model_dir, prompts, outputs)
        for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
            assert_logprobs_match_hf(hf_greedy(model_dir, prompt, MAX_TOKENS), out, f"{case} prompt {i}")
        load = llm.engine.core.get_stats().expert_load
        assert load["layers"] == expected_load["layers"] == list(range(len(load["layers"])))
        assert load["tokens"] == expected_load["tokens"]
        if parallel.get("enable_expert_parallel"):
            stats = llm.engine.core.executor.comm_stats()
            assert all(stats[rank]["tp.all_to_all"]["bytes"] > 0 for rank in (0, 1))
    finally:
        llm.shutdown()
