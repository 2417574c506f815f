"""The fork primitive: children share a parent's blocks by reference count and copy a shared
block only when they write into it. n > 1 and best_of compute the prompt once."""

from __future__ import annotations

import random

import pytest
from prefix_helpers import BLOCK_SIZE, StepRecorder, assert_drained, make_llm, random_tokens

from kvtide import SamplingParams
from kvtide.engine.request import EngineCoreRequest, Request
from kvtide.kv_cache.manager import KVCacheManager


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(EngineCoreRequest(req_id, tokens, SamplingParams()))


def _computed_parent(mgr: KVCacheManager, num_tokens: int) -> Request:
    """A parent whose `num_tokens` tokens are computed and that sampled one more."""
    parent = _request("p", list(range(100, 100 + num_tokens)))
    assert mgr.allocate_slots(parent, num_tokens) is not None
    parent.num_computed_tokens = num_tokens
    parent.append_output_token(7)
    return parent


# ---- manager level ---------------------------------------------------------------------------

def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    parent = _computed_parent(mgr, 10)  # blocks [full, full, partial: 2 of 4 written]
    child = _request("c", parent.all_token_ids[:10] + [8])  # a beam: same computed tokens, other next
    mgr.fork(parent, child)
    shared = mgr.req_to_blocks["p"]
    assert mgr.req_to_blocks["c"] == shared and [b.ref_cnt for b in shared] == [2, 2, 2]
    assert child.num_computed_tokens == 10
    mgr.check_integrity()

    assert mgr.allocate_slots(child, 1) == []  # writes token 10 into the shared partial block
    copies, rewritten = mgr.take_block_copies()
    new_last = mgr.req_to_blocks["c"][2]
    assert copies == [(shared[2].block_id, new_last.block_id)] and rewritten == {"c"}
    assert mgr.req_to_blocks["c"][:2] == shared[:2] and [b.ref_cnt for b in shared] == [2, 2, 1]
    assert mgr.allocate_slots(parent, 1) == []  # the last holder writes in place
    assert mgr.take_block_copies() == ([], set())
    mgr.check_integrity()
    mgr.free(child)
    mgr.free(parent)
    mgr.check_integrity()
    assert mgr.pool.num_free_blocks == 16


def test_fork_at_a_block_boundary_copies_nothing():
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    parent = _computed_parent(mgr, 8)
    child = _request("c", parent.all_token_ids[:8] + [9])
    mgr.fork(parent, child)
    new_blocks = mgr.allocate_slots(child, 1)
    assert len(new_blocks) == 1 and mgr.take_block_copies() == ([], set())
    mgr.check_integrity()


@pytest.mark.parametrize("prompt_len, num_copies", [(8, 1), (9, 0), (10, 1)])
def test_sibling_fork_recomputes_only_the_last_prompt_token(prompt_len, num_copies):
    """An n > 1 sibling (same prompt) starts one token short of the prompt, so it samples its own
    first token; the block holding that token is copied if shared (full or partial)."""
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    parent = _computed_parent(mgr, prompt_len)
    sibling = _request("s", parent.prompt_token_ids)
    mgr.fork(parent, sibling)
    assert sibling.num_computed_tokens == prompt_len - 1
    assert mgr.allocate_slots(sibling, 1) is not None
    copies, _ = mgr.take_block_copies()
    assert len(copies) == num_copies
    mgr.check_integrity()


def test_copy_on_write_that_does_not_fit_changes_nothing():
    mgr = KVCacheManager(num_blocks=3, block_size=4)
    parent = _computed_parent(mgr, 10)  # all 3 blocks
    child = _request("c", parent.all_token_ids[:10] + [8])
    mgr.fork(parent, child)
    before = [(b.block_id, b.ref_cnt) for b in mgr.req_to_blocks["c"]]
    assert mgr.allocate_slots(child, 1) is None
    assert [(b.block_id, b.ref_cnt) for b in mgr.req_to_blocks["c"]] == before
    assert mgr.take_block_copies() == ([], set())
    mgr.check_integrity()


# ---- engine level: n > 1 and best_of ---------------------------------------------------------

def _independent(llm, prompt, params: SamplingParams, n: int) -> list[list[int]]:
    outs = llm.generate([prompt] * n, [params.clone(n=1, seed=params.seed + i) for i in range(n)])
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("prompt_len", [2 * BLOCK_SIZE, 2 * BLOCK_SIZE + 1, 2 * BLOCK_SIZE + 7])
def test_seeded_n_equals_independent_requests_and_prompt_is_computed_once(llama_dir, caching, prompt_len):
    prompt = random_tokens(random.Random(prompt_len), prompt_len)
    params = SamplingParams(n=4, temperature=0.9, seed=100, max_tokens=10, ignore_eos=True)
    reference = _independent(make_llm(llama_dir, enable_prefix_caching=False), prompt, params, 4)
    llm = make_llm(llama_dir, enable_prefix_caching=caching)
    recorder = StepRecorder(llm)
    out = llm.generate([prompt], params)[0]
    assert [c.token_ids for c in out.outputs] == reference
    # The first sample computes the prompt; each other one only its last token.
    assert recorder.total_scheduled == prompt_len + 3 + 4 * (params.max_tokens - 1)
    assert recorder.block_copies == (0 if prompt_len % BLOCK_SIZE == 1 else 3)
    assert_drained(llm)


def test_n_with_stop_strings_best_of_and_logprobs(llama_dir):
    llm = make_llm(llama_dir)
    prompt = random_tokens(random.Random(9), 40)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, stop=["a", "e", "o"], logprobs=1)
    out = llm.generate([prompt], params)[0]
    assert [c.token_ids for c in out.outputs] == _independent(llm, prompt, params, 3)
    best = llm.generate([prompt], SamplingParams(n=2, best_of=5, temperature=1.0, seed=5, max_tokens=6))[0]
    assert len(best.outputs) == 2
    scores = [c.cumulative_logprob for c in best.outputs]
    everything = llm.generate([prompt], SamplingParams(n=5, temperature=1.0, seed=5, max_tokens=6,
                                                       logprobs=0))[0]
    assert sorted(scores, reverse=True) == sorted((c.cumulative_logprob for c in everything.outputs),
                                                  reverse=True)[:2]
    assert_drained(llm)


def test_n_under_forced_preemption(llama_dir):
    prompt = random_tokens(random.Random(10), 3 * BLOCK_SIZE + 5)
    params = SamplingParams(n=6, temperature=0.9, seed=3, max_tokens=40, ignore_eos=True)
    reference = _independent(make_llm(llama_dir), prompt, params, 6)
    bytes_per_block = 2 * BLOCK_SIZE * 2 * 32 * 4 * 4
    llm = make_llm(llama_dir, kv_cache_memory=str(16 * bytes_per_block), max_model_len=128)
    out = llm.generate([prompt], params)[0]
    assert llm.engine.core.get_stats().num_preemptions > 0
    assert [c.token_ids for c in out.outputs] == reference
    assert_drained(llm)


def test_parent_aborted_before_its_prompt_is_computed_releases_the_siblings(llama_dir):
    """Siblings held for a fork compute their own prompt if the first sample goes away first."""
    llm = make_llm(llama_dir, max_num_batched_tokens=16)
    core = llm.engine.core
    prompt = random_tokens(random.Random(12), 3 * BLOCK_SIZE + 3)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    core.add_request(EngineCoreRequest("0_x", prompt, params))
    for i in (1, 2):
        core.add_request(EngineCoreRequest(f"{i}_x", prompt, params, fork_of="0_x"))
    core.step()  # a first chunk of the parent's prompt
    assert core.scheduler.requests["1_x"].num_computed_tokens == 0
    core.abort_requests(["0_x"])
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    expected = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert tokens == {"1_x": expected, "2_x": expected}
    assert_drained(llm)


def test_aborting_n_mid_prefill_and_mid_decode_leaks_nothing(llama_dir):
    llm = make_llm(llama_dir, max_num_batched_tokens=16)
    engine = llm.engine
    prompt = random_tokens(random.Random(13), 3 * BLOCK_SIZE + 3)
    for steps in (1, 6):
        engine.add_request(f"r{steps}", prompt, SamplingParams(n=4, max_tokens=20, seed=1))
        for _ in range(steps):
            engine.step()
        engine.abort_request([f"r{steps}"])
        assert_drained(llm)


def test_eight_samples_use_a_quarter_of_the_blocks_of_eight_requests(llama_dir):
    """Issue figure: 8 parallel samples of a 1,000-token prompt hold at most 1/4 of the KV blocks
    that 8 independent requests hold (prefix caching off, so only the fork shares)."""
    prompt = random_tokens(random.Random(14), 1000)
    llm = make_llm(llama_dir, enable_prefix_caching=False)
    recorder = StepRecorder(llm)
    llm.generate([prompt], SamplingParams(n=8, temperature=0.8, seed=1, max_tokens=8, ignore_eos=True))
    forked = recorder.peak_used_blocks
    recorder.peak_used_blocks = 0
    llm.generate([prompt] * 8, [SamplingParams(temperature=0.8, seed=1 + i, max_tokens=8, ignore_eos=True)
                                for i in range(8)])
    independent = recorder.peak_used_blocks
    ratio = forked / independent
    print(f"8 samples of a 1000-token prompt: {forked} blocks forked vs {independent} independent "
          f"(ratio {ratio:.3f})")
    assert independent >= 8 * (-(-1000 // BLOCK_SIZE))
    assert ratio <= 0.25
