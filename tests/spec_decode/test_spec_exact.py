"""Speculative decoding changes speed, never tokens: every method against the same engine without it.

Greedy tokens and chosen-token logprobs equal non-speculative decoding (itself held to Hugging Face
in tests/models) at batch 1 and 16, with chunked prefill, forced preemption and a warm prefix
cache, on every architecture; seeded sampled requests draw the very same tokens; stops, max_tokens,
penalties, n > 1 and aborts mid-verification keep their meaning and leak no KV block.
"""

from __future__ import annotations

import random

import pytest

from kvtide import LLM, SamplingParams

MAX_TOKENS = 24
MAX_MODEL_LEN = 256
LOGPROB_TOL = 1e-4

_rng = random.Random(3)
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. The quick brown fox",
           "abc abc abc abc abc abc", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4, 5,"] + \
    [" ".join(_rng.choice(["spec", "token", "draft", "cat", "tide", "block", "cache", "the"])
              for _ in range(_rng.randint(2, 30))) for _ in range(12)]
"""16 prompts, 5 to ~200 tokens, some repetitive (the n-gram proposer finds matches)."""

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def make_llm(model_dir: str, spec: dict | None = None, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", "16MiB")
    kwargs.setdefault("enable_prefix_caching", False)
    if spec is not None:
        spec = {"disable_by_batch_size": 64, **spec}
    return LLM(model_dir, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, speculative_config=spec,
               **kwargs)


def method_configs(checkpoint_factory, model_dir: str) -> dict[str, dict]:
    """Each proposer, at full, partial and (nearly) no acceptance."""
    other = checkpoint_factory("LlamaForCausalLM", seed=0, num_hidden_layers=2)
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "layer_skip": {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 2, "adaptive": False},
        "draft-self": {"method": "draft_model", "num_speculative_tokens": 3, "model": model_dir, "adaptive": False},
        "draft-other": {"method": "draft_model", "num_speculative_tokens": 2, "model": other, "adaptive": False},
    }


@pytest.fixture(scope="module")
def reference(llama_dir):
    """Non-speculative outputs: prompt -> (tokens, chosen-token logprobs)."""
    llm = make_llm(llama_dir)
    return {p: summary(o) for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY), strict=True)}


def summary(out) -> tuple[list[int], list[float]]:
    completion = out.outputs[0]
    return completion.token_ids, [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs,
                                                                        strict=True)]


def assert_same(outputs, prompts, reference) -> None:
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens, logprobs = summary(out)
        ref_tokens, ref_logprobs = reference[prompt]
        assert tokens == ref_tokens, f"prompt {prompt[:30]!r}"
        assert logprobs == pytest.approx(ref_logprobs, abs=LOGPROB_TOL), f"prompt {prompt[:30]!r}"


def spec_stats(llm: LLM) -> dict:
    return llm.engine.core.get_stats().spec_decoding


@pytest.mark.parametrize("method", ["ngram", "layer_skip", "draft-self", "draft-other"])
def test_greedy_equals_non_speculative_at_batch_1_and_16(checkpoint_factory, llama_dir, reference, method):
    llm = make_llm(llama_dir, method_configs(checkpoint_factory, llama_dir)[method])
    assert_same(llm.generate(PROMPTS, GREEDY), PROMPTS, reference)
    for prompt in PROMPTS[:4]:
        assert_same(llm.generate([prompt], GREEDY), [prompt], reference)
    stats = spec_stats(llm)
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] >= stats["num_drafts"]
    assert sum(stats["accepted_per_pos"]) == stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    if method == "draft-self":  # the target as its own draft: every draft is accepted
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    if method in ("layer_skip", "draft-other"):  # partial acceptance exercises the rollback
        assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert llm.engine.core.scheduler.kv_cache_manager.pool.num_used_blocks == 0


@pytest.mark.parametrize("method", ["ngram", "draft-self", "draft-other"])
def test_chunked_prefill_preemption_and_warm_prefix_cache(checkpoint_factory, llama_dir, reference, method):
    config = method_configs(checkpoint_factory, llama_dir)[method]
    probe = make_llm(llama_dir, config, kv_cache_memory="1MiB")
    block_bytes = probe.engine.core.executor.kv_bytes_per_block()
    del probe
    num_blocks = 20  # room for the longest request (14 blocks) and little else: preemption is certain
    llm = make_llm(llama_dir, config, kv_cache_memory=str(num_blocks * block_bytes), enable_prefix_caching=True,
                   max_num_batched_tokens=32)
    assert_same(llm.generate(PROMPTS, GREEDY), PROMPTS, reference)
    scheduler = llm.engine.core.scheduler
    assert scheduler.num_preemptions > 0
    llm.generate(PROMPTS[1:4], GREEDY)
    warm = llm.generate(PROMPTS[1:4], GREEDY)
    assert_same(warm, PROMPTS[1:4], reference)
    assert min(o.num_cached_tokens for o in warm) >= 16
    assert spec_stats(llm)["num_drafts"] > 0
    scheduler.kv_cache_manager.check_integrity()
    assert scheduler.kv_cache_manager.pool.num_used_blocks == 0


ARCHITECTURES = {
    "mistral-sliding-window": ("MistralForCausalLM", dict(sliding_window=16)),
    "qwen2-bias-tied": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3-qk-norm": ("Qwen3ForCausalLM", dict(head_dim=64)),
    "llama-mqa": ("LlamaForCausalLM", dict(num_key_value_heads=1)),
}


@pytest.mark.parametrize("case", list(ARCHITECTURES))
def test_every_architecture(checkpoint_factory, case):
    architecture, overrides = ARCHITECTURES[case]
    model_dir = checkpoint_factory(architecture, **overrides)
    prompts = PROMPTS[:6]
    ref = {p: summary(o) for p, o in zip(prompts, make_llm(model_dir).generate(prompts, GREEDY), strict=True)}
    for config in ({"method": "draft_model", "num_speculative_tokens": 4, "model": model_dir, "adaptive": False},
                   {"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 1, "adaptive": False}):
        assert_same(make_llm(model_dir, config).generate(prompts, GREEDY), prompts, ref)


@pytest.fixture(scope="module")
def self_draft_pair(llama_dir):
    config = {"method": "draft_model", "num_speculative_tokens": 3, "model": llama_dir, "adaptive": False}
    return make_llm(llama_dir), make_llm(llama_dir, config)


@pytest.fixture(scope="module")
def layer_skip_pair(llama_dir):
    """Early exit at the first of 4 layers: argmax drafts, partly accepted."""
    config = {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 1, "adaptive": False}
    return make_llm(llama_dir), make_llm(llama_dir, config)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2,
                   max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(n=2, temperature=0.7, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
    SamplingParams(temperature=0, min_tokens=6, max_tokens=MAX_TOKENS, logit_bias={65: 3.0}),
], ids=["seeded", "seeded-top-p-top-k", "penalties", "n2-seeded", "max-tokens-5", "min-tokens-bias"])
def test_sampling_options_equal_non_speculative(layer_skip_pair, self_draft_pair, params):
    """With one-hot proposals the verifier samples each position as a decode step would (same seed
    per output position, the drafts before it in the penalty history), so even sampled requests
    draw the same tokens. A draft model's greedy requests too."""
    pairs = [layer_skip_pair] + ([self_draft_pair] if params.temperature == 0 else [])
    prompts = PROMPTS[:6]
    for base, spec in pairs:
        expected = [[c.token_ids for c in o.outputs] for o in base.generate(prompts, params)]
        before = spec_stats(spec)["num_accepted_tokens"]
        got = [[c.token_ids for c in o.outputs] for o in spec.generate(prompts, params)]
        assert got == expected
        assert spec_stats(spec)["num_accepted_tokens"] > before


def test_draft_model_samples_drafts_from_its_distribution(self_draft_pair):
    """A sampled request's drafts come from the draft's processed distribution q and are verified by
    rejection sampling: the target drafting for itself (q = p) has nearly every draft accepted,
    where argmax drafts would be accepted only with probability p(argmax). A seeded request draws the
    same tokens alone or in a batch (its noise depends on its seed and output position only)."""
    _, spec = self_draft_pair
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True,
                            presence_penalty=0.3, logprobs=1)
    before = dict(spec_stats(spec))
    outputs = spec.generate(PROMPTS[:8], params)
    after = spec_stats(spec)
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert drafted > 50 and accepted / drafted > 0.97
    alone = spec.generate(PROMPTS[2:3], params)[0].outputs[0]
    assert alone.token_ids == outputs[2].outputs[0].token_ids
    for out in outputs:  # each reported logprob belongs to the emitted token
        completion = out.outputs[0]
        assert all(t in entry for t, entry in zip(completion.token_ids, completion.logprobs, strict=True))


def test_stop_inside_an_accepted_run(self_draft_pair):
    """A stop token or string in the middle of an accepted run ends the request there."""
    base, spec = self_draft_pair
    prompt = PROMPTS[3]
    free = base.generate([prompt], GREEDY)[0].outputs[0]
    stop_token = free.token_ids[9]
    first = free.token_ids.index(stop_token)
    for params in (SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_token]),
                   SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[free.text[10:14]] if
                                  len(free.text) > 14 else None)):
        want = base.generate([prompt], params)[0].outputs[0]
        got = spec.generate([prompt], params)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert base.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                  stop_token_ids=[stop_token]))[0].outputs[0].token_ids \
        == free.token_ids[:first + 1]


def test_per_request_switch_and_batch_threshold(llama_dir, reference):
    config = {"method": "draft_model", "num_speculative_tokens": 3, "model": llama_dir, "adaptive": False}
    llm = LLM(llama_dir, device="cpu", max_model_len=MAX_MODEL_LEN, kv_cache_memory="16MiB",
              speculative_config={**config, "disable_by_batch_size": 4})
    off = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, speculation=False)
    assert_same(llm.generate(PROMPTS[:2], off), PROMPTS[:2], reference)
    assert spec_stats(llm)["num_drafts"] == 0
    assert_same(llm.generate(PROMPTS, GREEDY), PROMPTS, reference)  # batch 16 > 4: none until it drains
    during_large = spec_stats(llm)["num_drafts"]
    assert_same(llm.generate(PROMPTS[:2], GREEDY), PROMPTS[:2], reference)
    assert spec_stats(llm)["num_drafts"] >= during_large + 2 * (MAX_TOKENS - 1) // 4


def test_aborts_mid_verification_leak_nothing(llama_dir):
    config = {"method": "draft_model", "num_speculative_tokens": 3, "model": llama_dir, "adaptive": False}
    llm = make_llm(llama_dir, config, enable_prefix_caching=True, kv_cache_memory="2MiB")
    engine = llm.engine
    rng = random.Random(0)
    live: list[str] = []
    for step in range(120):
        if step < 80 and rng.random() < 0.5:
            request_id = engine.next_request_id()
            engine.add_request(request_id, rng.choice(PROMPTS), SamplingParams(temperature=0, max_tokens=40))
            live.append(request_id)
        if live and rng.random() < 0.3:
            victims = rng.sample(live, k=min(len(live), rng.randint(1, 3)))
            engine.abort_request(victims)
            live = [r for r in live if r not in victims]
        engine.step()
        engine.core.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    assert spec_stats(llm)["num_drafts"] > 0
    engine.core.check_integrity()
    assert engine.core.scheduler.kv_cache_manager.pool.num_used_blocks == 0


def test_engine_logs_acceptance(self_draft_pair, monkeypatch, caplog):
    import kvtide.engine.core as core

    monkeypatch.setattr(core, "SPEC_LOG_INTERVAL_S", 0.0)
    _, spec = self_draft_pair
    with caplog.at_level("INFO", logger="kvtide.engine.core"):
        spec.generate(PROMPTS[:2], GREEDY)
    lines = [r.getMessage() for r in caplog.records if "speculative decoding:" in r.getMessage()]
    lines = lines[1:]  # the first covers everything since the (shared) engine started
    assert lines and all("acceptance rate 1.000" in line for line in lines)
    assert any("mean accepted length 4.00" in line for line in lines)  # K = 3 drafts + the bonus token
