"""Layer groups end to end (kv_cache/hybrid.py): a tiny Qwen2 whose layers 0-1 attend fully and
layers 2-3 within a 24-token window keeps a block table per layer kind. It generates 1,000 greedy
tokens equal to Hugging Face's in float32 while the windowed group holds only the blocks its window
reads, the same memory runs more sequences at once than one table per request, and prefix hits,
preemption, forks, a quantized cache and n-gram speculation give the tokens they give without groups.

After every step the K/V of each free block is overwritten with a large constant, as a reuse by
another request would: a block freed while a layer still reads it changes the tokens.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import LONG_PROMPT, hf_greedy, random_prompts

from kvtide import LLM, SamplingParams
from kvtide.kv_cache.hybrid import HybridKVCacheManager
from kvtide.kv_cache.manager import cdiv

WINDOW = 24
BLOCK_SIZE = 16
BUDGET = 32
"""Tokens per step: prompts are prefilled in chunks, each freeing what left the window."""
QWEN2_MIXED = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, hidden_size=64,
                   intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=2048)


@pytest.fixture(scope="module")
def mixed_dir(checkpoint_factory) -> str:
    """Seeded and peaked (initializer_range 0.2), so greedy tokens have no near-ties."""
    return checkpoint_factory("Qwen2ForCausalLM", **QWEN2_MIXED)


def make_llm(model_dir: str, max_model_len: int, pool_tokens: int | None = None, **kwargs) -> LLM:
    """float32 on CPU, 32-token steps; `pool_tokens`: memory for that many tokens of every layer
    (what one table per request needs for them)."""
    memory = "64MiB"
    if pool_tokens is not None:
        probe = LLM(model_dir, device="cpu", dtype="float32", max_model_len=max_model_len, block_size=BLOCK_SIZE,
                    kv_cache_memory="1MiB", disable_hybrid_kv_cache_manager=True)
        memory = str(cdiv(pool_tokens, BLOCK_SIZE) * probe.engine.core.executor.kv_bytes_per_block())
    return LLM(model_dir, device="cpu", dtype="float32", max_model_len=max_model_len, block_size=BLOCK_SIZE,
               kv_cache_memory=memory, max_num_batched_tokens=BUDGET, **kwargs)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def poison_free_blocks(llm: LLM) -> None:
    manager = llm.engine.core.scheduler.kv_cache_manager
    free = [b.block_id for b in manager.pool.blocks if b.ref_cnt == 0 and b.block_hash is None]
    if free:
        for cache in llm.engine.core.executor.runner.kv_caches:
            cache.index_fill_(list(cache.shape).index(manager.num_blocks), torch.tensor(free), 30.0)


def run(llm: LLM, prompts: dict[str, str], max_tokens: int, add_after_prefill: str | None = None):
    """Step the engine, poisoning free blocks before each step. Returns the outputs and, per request
    and group, the blocks it held after its last step."""
    engine = llm.engine
    manager = engine.core.scheduler.kv_cache_manager
    for rid, prompt in prompts.items():
        if rid != add_after_prefill:
            engine.add_request(rid, prompt, greedy(max_tokens))
    outputs, last = {}, {}
    while engine.has_unfinished_requests():
        poison_free_blocks(llm)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        if isinstance(manager, HybridKVCacheManager):
            for core_id in manager.req_to_blocks:
                last[core_id] = [m.num_live_blocks(core_id) for m in manager.managers]
        if add_after_prefill is not None and all(r.num_output_tokens for r in engine.core.scheduler.running):
            engine.add_request(add_after_prefill, prompts[add_after_prefill], greedy(max_tokens))
            add_after_prefill = None
    manager.check_integrity()
    assert manager.pool.num_used_blocks == 0
    return outputs, last


def assert_hf(model_dir: str, rid: str, prompt: str, got: list[int], max_tokens: int) -> None:
    ref = hf_greedy(model_dir, prompt, max_tokens).token_ids
    if got != ref:
        first = next(i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b)
        pytest.fail(f"{rid}: first differing token at {first}: kvtide {got[first:first + 5]} vs HF {ref[first:first + 5]}")


def test_long_generation_matches_hf_and_the_windowed_group_holds_only_its_window(mixed_dir):
    num_tokens = 1000
    llm = make_llm(mixed_dir, max_model_len=1100, enable_prefix_caching=False)
    manager = llm.engine.core.scheduler.kv_cache_manager
    assert isinstance(manager, HybridKVCacheManager)
    assert [(g.window, g.layers) for g in manager.groups] == [(None, (0, 1)), (WINDOW, (2, 3))]
    prompts = {"hello": "Hello, sliding window", "fox": "The quick brown fox"}
    outputs, last = run(llm, prompts, num_tokens)
    for rid, prompt in prompts.items():
        assert_hf(mixed_dir, rid, prompt, outputs[rid].outputs[0].token_ids, num_tokens)
    for held in last.values():  # after the last step: ~1,020 tokens of KV
        full, windowed = held
        assert full >= cdiv(1000, BLOCK_SIZE)
        assert windowed <= cdiv(WINDOW, BLOCK_SIZE) + 2


def test_groups_change_hf_tokens_over_one_table(checkpoint_factory, mixed_dir):
    """Guard: the same weights with every layer attending fully continue differently, so matching
    HF above really checks the windowed layers' window."""
    full = checkpoint_factory("Qwen2ForCausalLM", **dict(QWEN2_MIXED, use_sliding_window=False))
    prompt = "Hello, sliding window"
    assert hf_greedy(full, prompt, 300).token_ids != hf_greedy(mixed_dir, prompt, 300).token_ids


def test_the_same_memory_runs_more_sequences_at_once(mixed_dir):
    """Memory for 4 sequences of 330 tokens under one table per request: with groups the pool has
    twice the blocks (each holds 2 layers, not 4) and a sequence needs 21 full + at most 5 windowed
    ones, so 6 run at once without preemption, where one table preempts. Tokens are the same."""
    prompts = {f"p{i}": p for i, p in enumerate(random_prompts(6, seed=5, min_words=2, max_words=2))}
    max_tokens = 320
    results = {}
    for hybrid in (True, False):
        llm = make_llm(mixed_dir, max_model_len=400, pool_tokens=4 * 336, max_num_seqs=6,
                       disable_hybrid_kv_cache_manager=not hybrid)
        manager = llm.engine.core.scheduler.kv_cache_manager
        assert isinstance(manager, HybridKVCacheManager) == hybrid
        outputs, _ = run(llm, prompts, max_tokens)
        results[hybrid] = ({r: o.outputs[0].token_ids for r, o in outputs.items()}, manager.num_blocks,
                           llm.engine.core.scheduler.num_preemptions)
    (tokens_groups, blocks_groups, preempt_groups), (tokens_one, blocks_one, preempt_one) = results[True], results[False]
    assert blocks_groups == 2 * blocks_one
    assert preempt_groups == 0 and preempt_one > 0
    assert tokens_groups == tokens_one
    for rid in ("p0", "p5"):
        assert_hf(mixed_dir, rid, prompts[rid], tokens_groups[rid], max_tokens)


def test_prefix_hits_under_groups_match_hf(mixed_dir):
    """The second request shares the first's 120-token prompt: every group has its blocks cached,
    it takes them and continues exactly as HF does."""
    shared = LONG_PROMPT[:120]
    prompts = {"first": shared, "second": shared + " and then"}
    llm = make_llm(mixed_dir, max_model_len=400, enable_prefix_caching=True)
    outputs, _ = run(llm, prompts, 100, add_after_prefill="second")
    assert outputs["second"].num_cached_tokens >= 96
    for rid, prompt in prompts.items():
        assert_hf(mixed_dir, rid, prompt, outputs[rid].outputs[0].token_ids, 100)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["recompute", "recompute-prefix-cached"])
def test_preemption_under_groups_matches_hf(mixed_dir, prefix_caching):
    prompts = {f"p{i}": p for i, p in enumerate(random_prompts(5, seed=3, min_words=8, max_words=10))}
    llm = make_llm(mixed_dir, max_model_len=128, pool_tokens=160, enable_prefix_caching=prefix_caching)
    outputs, _ = run(llm, prompts, 50)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert_hf(mixed_dir, rid, prompt, outputs[rid].outputs[0].token_ids, 50)


def test_forks_quantized_caches_and_ngram_speculation_under_groups(mixed_dir):
    """n = 2 (children share the parent's blocks in every group, copy-on-write on the partial one),
    an int8 cache in the groups' slot tensors, and n-gram drafts verified through the groups' tables:
    each gives the tokens it gives with one table per request."""
    prompt = LONG_PROMPT[:70]
    cases = {"fork": (dict(), greedy(120, n=2)),
             "int8": (dict(kv_cache_dtype="int8"), greedy(120)),
             "ngram": (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}), greedy(120))}
    for name, (kwargs, params) in cases.items():
        got = {}
        for hybrid in (True, False):
            llm = make_llm(mixed_dir, max_model_len=400, disable_hybrid_kv_cache_manager=not hybrid, **kwargs)
            assert isinstance(llm.engine.core.scheduler.kv_cache_manager, HybridKVCacheManager) == hybrid
            got[hybrid] = [c.token_ids for c in llm.generate([prompt], params)[0].outputs]
            manager = llm.engine.core.scheduler.kv_cache_manager
            manager.check_integrity()
            assert manager.pool.num_used_blocks == 0
        assert got[True] == got[False], name
        if name != "int8":
            assert all(t == hf_greedy(mixed_dir, prompt, 120).token_ids for t in got[True]), name


def test_a_lone_one_block_request_matches_hf(mixed_dir):
    """One request whose prompt fits one block: each group's table is a 1 x 1 slice of the flat one
    (the compiled kernel wants a unit stride there)."""
    llm = make_llm(mixed_dir, max_model_len=400)
    out = llm.generate(["Hi"], greedy(40))[0]
    assert len(out.prompt_token_ids) < BLOCK_SIZE
    assert_hf(mixed_dir, "hi", "Hi", out.outputs[0].token_ids, 40)


def test_connectors_and_the_flag_keep_one_table(mixed_dir):
    for kwargs in (dict(disable_hybrid_kv_cache_manager=True), dict(kv_offload_memory="16MiB"),
                   dict(kv_drop_policy="score", kv_drop_budget=0.5, enable_prefix_caching=False)):
        llm = make_llm(mixed_dir, max_model_len=400, **kwargs)
        manager = llm.engine.core.scheduler.kv_cache_manager
        assert not isinstance(manager, HybridKVCacheManager), kwargs
