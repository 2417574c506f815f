"""Differential: greedy output with the prefix cache off == cold cache == warm cache.

Prompts share nothing, one partial block, or many full blocks; batches of 1 and 16; after earlier
requests that ended mid-block (stop string, abort); with preemption forced by a small cache.
"""

from __future__ import annotations

import functools
import random

import pytest
from prefix_helpers import BLOCK_SIZE, assert_drained, greedy, make_llm, prompt_set, random_tokens, tokens_of

from kvtide import SamplingParams

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def reference(llama_dir):
    """Greedy tokens per prompt with the cache off (memoized)."""
    llm = make_llm(llama_dir, enable_prefix_caching=False)

    @functools.cache
    def run(prompts: tuple[tuple[int, ...], ...], max_tokens: int = MAX_TOKENS):
        outputs = llm.generate([list(p) for p in prompts], greedy(max_tokens))
        assert all(o.num_cached_tokens == 0 for o in outputs)
        return tokens_of(outputs)

    return run


@pytest.mark.parametrize("batch_size", [1, 16])
@pytest.mark.parametrize("kind", ["none", "partial", "full"])
def test_cache_off_equals_cold_equals_warm(llama_dir, reference, kind, batch_size):
    prompts = prompt_set(kind, 16 if batch_size == 16 else 4, seed={"none": 1, "partial": 2, "full": 3}[kind])
    expected = reference(tuple(map(tuple, prompts)))
    llm = make_llm(llama_dir)
    for phase in ("cold", "warm"):
        if batch_size == 1:
            outputs = [llm.generate([p], greedy(MAX_TOKENS))[0] for p in prompts]
        else:
            outputs = llm.generate(prompts, greedy(MAX_TOKENS))
        assert tokens_of(outputs) == expected, phase
        cached = [o.num_cached_tokens for o in outputs]
        assert all(c % BLOCK_SIZE == 0 and c < len(p) for c, p in zip(cached, prompts, strict=True))
        if phase == "warm":  # everything but the last (partial or recomputed) block was seen before
            assert cached == [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]
        elif kind == "full":  # batch 16: hits on blocks the first prompt publishes in the same step
            assert cached[1:] == [5 * BLOCK_SIZE] * (len(prompts) - 1)
        elif kind != "full":
            assert sum(cached) == 0
    assert_drained(llm)


def test_after_requests_ended_mid_block_by_stop_string_or_abort(llama_dir, reference):
    """Blocks written by requests that stopped on a stop string or were aborted mid-block are
    reused (full ones) or discarded (partial ones) without corrupting later outputs."""
    rng = random.Random(7)
    llm = make_llm(llama_dir)
    tokenizer = llm.get_tokenizer()
    base = [random_tokens(rng, BLOCK_SIZE * 2 + 5) for _ in range(4)]
    probe = llm.generate(base, greedy(24))
    # Stop strings (a printable ASCII byte generated a few tokens in) end each request mid-block.
    stops = []
    for o in probe:
        k = next(k for k in range(4, 16) if 0x21 <= o.outputs[0].token_ids[k] - 3 <= 0x7E)
        stops.append(tokenizer.decode([o.outputs[0].token_ids[k]]))
    llm.reset_prefix_cache()
    stopped = llm.generate(base, [greedy(24, stop=[s]) for s in stops])
    assert all(o.outputs[0].finish_reason == "stop" and len(o.outputs[0].token_ids) < 24 for o in stopped)
    # Aborted after a few steps.
    engine = llm.engine
    aborted = [random_tokens(rng, BLOCK_SIZE * 3 + 3) for _ in range(3)]
    ids = []
    for prompt in aborted:
        ids.append(engine.next_request_id())
        engine.add_request(ids[-1], prompt, greedy(24))
    for _ in range(4):
        engine.step()
    engine.abort_request(ids)
    assert_drained(llm)
    # Prompts that run into those sequences' blocks: the prompts, prompts + generated tokens,
    # and prompts that diverge inside a cached block.
    follow = [p + o.outputs[0].token_ids[:k] for p, o in zip(base, probe, strict=True) for k in (3, 11)]
    follow += [p[:BLOCK_SIZE + 4] + random_tokens(rng, 9) for p in base + aborted]
    follow += [p + random_tokens(rng, 4) for p in aborted]
    expected = reference(tuple(map(tuple, follow)))
    outputs = llm.generate(follow, greedy(MAX_TOKENS))
    assert tokens_of(outputs) == expected
    assert sum(o.num_cached_tokens for o in outputs) > 0
    assert_drained(llm)


def test_forced_preemption(llama_dir, reference):
    """A cache of 24 blocks for 16 requests of ~6 blocks: requests are preempted and recomputed,
    hitting their own freed blocks, and the output does not change."""
    prompts = prompt_set("full", 16, seed=3)
    expected = reference(tuple(map(tuple, prompts)))
    bytes_per_block = 2 * BLOCK_SIZE * 2 * 32 * 4 * 4  # k+v, block, kv heads, head dim, fp32, layers
    llm = make_llm(llama_dir, kv_cache_memory=str(24 * bytes_per_block), max_model_len=256)
    assert llm.engine.core.config.cache_config.num_blocks == 24
    outputs = llm.generate(prompts, greedy(MAX_TOKENS))
    stats = llm.engine.core.get_stats()
    assert stats.num_preemptions > 0
    assert tokens_of(outputs) == expected
    assert any(o.num_cached_tokens > 0 for o in outputs)
    assert_drained(llm)


def test_two_identical_prompts_in_one_step(llama_dir, reference):
    """The second request hits blocks the first publishes in the same step (written by the same
    forward pass, before attention reads them) and gives the same output."""
    prompt = random_tokens(random.Random(11), 3 * BLOCK_SIZE + 7)
    llm = make_llm(llama_dir)
    outputs = llm.generate([prompt, prompt], greedy(MAX_TOKENS))
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
    assert tokens_of(outputs[:1]) == reference((tuple(prompt),))
    assert [o.num_cached_tokens for o in outputs] == [0, 3 * BLOCK_SIZE]
    assert llm.engine.core.num_steps == MAX_TOKENS  # both ran together from the first step


def test_cache_off_reports_no_hits(llama_dir):
    prompt = random_tokens(random.Random(5), 4 * BLOCK_SIZE)
    llm = make_llm(llama_dir, enable_prefix_caching=False)
    for _ in range(2):
        assert llm.generate([prompt], greedy(2))[0].num_cached_tokens == 0
    stats = llm.engine.core.get_stats()
    assert stats.prefix_cache_queries == stats.prefix_cache_hits == stats.num_evictable_blocks == 0


def test_prompt_logprobs_skip_the_cache_and_stay_exact(llama_dir):
    """Prompt logprobs need every prompt position computed, so such requests take no hits."""
    prompt = random_tokens(random.Random(6), 3 * BLOCK_SIZE)
    llm = make_llm(llama_dir)
    first = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    again = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert again.num_cached_tokens == 0
    def chosen(output):
        return [next(iter(entry.values())).logprob for entry in output.prompt_logprobs[1:]]

    assert len(chosen(again)) == len(prompt) - 1
    assert chosen(again) == pytest.approx(chosen(first), abs=1e-5)
