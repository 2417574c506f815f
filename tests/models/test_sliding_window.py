"""Sliding-window block freeing end to end: a tiny Mistral (window 24) generates 1,000 greedy tokens
equal to Hugging Face's in float32 while each request holds only the blocks its window reads (3 of
the 64 its sequence spans); prefix hits under the window stay exact.

After every step the K/V of each free block is overwritten with a large constant, as a reuse by
another request would: a block freed while still inside the window, or a freed table entry read
under a nonzero weight, then changes the tokens.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import LONG_PROMPT, hf_greedy, random_prompts

from kvtide import LLM, SamplingParams
from kvtide.kv_cache.manager import cdiv

WINDOW = 24
BLOCK_SIZE = 16
NUM_TOKENS = 1000
MAX_MODEL_LEN = 1100
BUDGET = 32
"""Tokens per step: prompts are prefilled in chunks, each freeing what left the window."""
PROMPTS = {"hello": "Hello, sliding window", "fox": "The quick brown fox"}


@pytest.fixture(scope="module")
def mistral_dir(checkpoint_factory) -> str:
    """Seeded and peaked (initializer_range 0.2, see make_random_checkpoint), so greedy tokens have
    no near-ties over a long generation."""
    return checkpoint_factory("MistralForCausalLM", sliding_window=WINDOW, hidden_size=64,
                              intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=2048)


def make_llm(model_dir: str, enable_prefix_caching: bool, max_model_len: int = MAX_MODEL_LEN) -> LLM:
    """float32 on CPU, with a pool of just max_model_len tokens (the least the engine accepts)."""
    probe = LLM(model_dir, device="cpu", dtype="float32", max_model_len=max_model_len, block_size=BLOCK_SIZE,
                kv_cache_memory="1MiB")
    num_blocks = cdiv(max_model_len, BLOCK_SIZE)
    memory = num_blocks * probe.engine.core.executor.kv_bytes_per_block()
    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=max_model_len, block_size=BLOCK_SIZE,
              kv_cache_memory=str(memory), max_num_batched_tokens=BUDGET, enable_prefix_caching=enable_prefix_caching)
    manager = llm.engine.core.scheduler.kv_cache_manager
    assert manager.sliding_window == WINDOW and manager.num_blocks == num_blocks
    return llm


def poison_free_blocks(llm: LLM) -> None:
    """Overwrite the K/V of every free block that no prefix lookup can return with a large finite
    value (masked slots must stay finite: they are read under a zero weight)."""
    manager = llm.engine.core.scheduler.kv_cache_manager
    free = [b.block_id for b in manager.pool.blocks if b.ref_cnt == 0 and b.block_hash is None]
    if not free:
        return
    ids = torch.tensor(free)
    for cache in llm.engine.core.executor.runner.kv_caches:
        assert list(cache.shape).count(manager.num_blocks) == 1, cache.shape
        cache.index_fill_(list(cache.shape).index(manager.num_blocks), ids, 30.0)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run(llm: LLM, prompts: dict[str, str], max_tokens: int, add_after_prefill: str | None = None):
    """Step the engine over the prompts, poisoning free blocks before each step. Returns the
    finished outputs and, per request, the most blocks it held after any step and those it held
    after its last one. `add_after_prefill` names a prompt added only once the others' prompts are
    computed (so it can hit their blocks)."""
    engine = llm.engine
    manager = engine.core.scheduler.kv_cache_manager
    for rid, prompt in prompts.items():
        if rid != add_after_prefill:
            engine.add_request(rid, prompt, greedy(max_tokens))
    outputs, peak, last = {}, {}, {}
    while engine.has_unfinished_requests():
        poison_free_blocks(llm)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        for core_id in manager.req_to_blocks:
            held = manager.num_live_blocks(core_id)
            peak[core_id], last[core_id] = max(peak.get(core_id, 0), held), held
        if add_after_prefill is not None and add_after_prefill not in outputs and \
                all(r.num_output_tokens for r in engine.core.scheduler.running):
            engine.add_request(add_after_prefill, prompts[add_after_prefill], greedy(max_tokens))
            add_after_prefill = None
    manager.check_integrity()
    assert manager.pool.num_used_blocks == 0
    return outputs, peak, last


def test_long_generation_matches_hf_and_holds_only_the_window(mistral_dir):
    llm = make_llm(mistral_dir, enable_prefix_caching=False)
    outputs, peak, last = run(llm, PROMPTS, NUM_TOKENS)
    bound = cdiv(WINDOW, BLOCK_SIZE) + 2
    for rid, prompt in PROMPTS.items():
        ref = hf_greedy(mistral_dir, prompt, NUM_TOKENS)
        got = outputs[rid].outputs[0].token_ids
        assert outputs[rid].prompt_token_ids == ref.prompt_ids
        if got != ref.token_ids:
            first = next(i for i, (a, b) in enumerate(zip(got, ref.token_ids, strict=True)) if a != b)
            pytest.fail(f"{rid}: first differing token at {first}: kvtide {got[first:first + 5]} vs HF "
                        f"{ref.token_ids[first:first + 5]}")
        assert cdiv(len(ref.prompt_ids) + NUM_TOKENS, BLOCK_SIZE) > 10 * bound
    assert len(last) == len(PROMPTS)
    assert max(last.values()) <= bound and max(peak.values()) <= bound


def test_the_window_changes_hf_tokens(checkpoint_factory, mistral_dir):
    """Guard: the same weights without a window continue differently, so matching HF over 1,000
    tokens really checks that nothing inside the window was lost."""
    full = checkpoint_factory("MistralForCausalLM", sliding_window=None, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=2048)
    prompt = PROMPTS["hello"]
    assert hf_greedy(full, prompt, NUM_TOKENS).token_ids != hf_greedy(mistral_dir, prompt, NUM_TOKENS).token_ids


def test_prefix_hits_under_a_window_match_hf(mistral_dir):
    """The second request shares the first's 120-token prompt: it takes the cached blocks its
    window reads (not the ones before it) and continues exactly as HF does."""
    shared = LONG_PROMPT[:120]
    prompts = {"first": shared, "second": shared + " and then"}
    llm = make_llm(mistral_dir, enable_prefix_caching=True)
    max_tokens = 200
    outputs, peak, _ = run(llm, prompts, max_tokens, add_after_prefill="second")
    assert outputs["second"].num_cached_tokens >= 96
    for rid, prompt in prompts.items():
        assert outputs[rid].outputs[0].token_ids == hf_greedy(mistral_dir, prompt, max_tokens).token_ids, rid
    manager = llm.engine.core.scheduler.kv_cache_manager
    assert max(peak.values()) <= manager.max_blocks_held(MAX_MODEL_LEN, BUDGET) == 5


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["recompute", "recompute-prefix-cached"])
def test_preemption_under_a_window_matches_hf(mistral_dir, prefix_caching):
    """A pool of 8 blocks: prefilling requests grow past what the others give back, so some are
    preempted and recomputed (freeing again as they go); every output still equals HF's."""
    prompts = {f"p{i}": p for i, p in enumerate(random_prompts(5, seed=3, min_words=8, max_words=10))}
    max_tokens = 50
    llm = make_llm(mistral_dir, enable_prefix_caching=prefix_caching, max_model_len=128)
    outputs, _, _ = run(llm, prompts, max_tokens)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert outputs[rid].outputs[0].token_ids == hf_greedy(mistral_dir, prompt, max_tokens).token_ids, rid
