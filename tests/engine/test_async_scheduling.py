"""Async scheduling on the real engine: the step after the one running is scheduled ahead, and its
outputs are the same as the synchronous engine's, through stops, preemption, chunked prefill,
prefix hits, n > 1, logprobs and beam search (which waits for each step)."""

from __future__ import annotations

import pytest

from kvtide import LLM, SamplingParams
from kvtide.sampling_params import BeamSearchParams

PROMPTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog. " * 2, "a", "Hello, world"]


LOGPROB_TOL = 1e-4
"""Steps scheduled ahead batch rows differently (a row computed for a request that just stopped,
preemption at other steps), and a matmul's sums change with its row count (on CPU even its kernel:
cpu_gemm picks one per row-count bucket): tokens stay equal, logprobs agree within the project's
1e-4 (measured up to 1.2e-5 on a Zen 5 EPYC, under 1e-5 on Zen 4)."""


def outputs_of(llm: LLM, prompts, params) -> list:
    """Per request: prompt ids, and per sample (tokens, text, finish reason, stop reason), with
    the sample and prompt logprobs as flat (token, rank, logprob) lists."""
    def flat(entries):
        return [[(tok, lp.rank, lp.logprob) for tok, lp in sorted(e.items())] if e else e
                for e in entries or []]
    outs = llm.generate(prompts, params)
    return [(o.prompt_token_ids, [(c.token_ids, c.text, c.finish_reason, c.stop_reason, flat(c.logprobs))
                                  for c in o.outputs], flat(o.prompt_logprobs)) for o in outs]


def assert_same(got: list, expected: list) -> None:
    """Equal in everything but logprob values, which must agree within LOGPROB_TOL."""
    def split(outs):
        values: list[float] = []

        def strip(entries):
            stripped = []
            for e in entries:
                if e:
                    values.extend(lp for _, _, lp in e)
                    e = [(tok, rank) for tok, rank, _ in e]
                stripped.append(e)
            return stripped
        exact = [(ids, [(*c[:4], strip(c[4])) for c in samples], strip(plp)) for ids, samples, plp in outs]
        return exact, values
    (exact_got, lp_got), (exact_exp, lp_exp) = split(got), split(expected)
    assert exact_got == exact_exp
    assert len(lp_got) == len(lp_exp)
    assert max((abs(a - b) for a, b in zip(lp_got, lp_exp, strict=True)), default=0.0) <= LOGPROB_TOL


def assert_idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    llm.engine.core.check_integrity()
    assert llm.engine.core.scheduler.kv_cache_manager.pool.num_used_blocks == 0


@pytest.fixture(scope="module")
def engines(llama_dir):
    """The same engine synchronous and scheduled ahead; a small pool and budget, so requests are
    preempted and prompts chunked."""
    block_bytes = LLM(model=llama_dir, dtype="float32", max_model_len=256,
                      kv_cache_memory="1MiB").engine.core.executor.kv_bytes_per_block()
    pool = str((256 // 16 + 3) * block_bytes)  # the longest request and little else
    made = {mode: LLM(model=llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=pool,
                      max_num_batched_tokens=48, async_scheduling=mode) for mode in (False, True)}
    assert made[True].engine.core._worker is not None and made[False].engine.core._worker is None
    return made


def test_greedy_stops_and_logprobs_equal_sync(engines):
    greedy = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=40, stop=["the"]),
              SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, min_tokens=4)]
    sync = outputs_of(engines[False], PROMPTS * 3, greedy * 3)
    ahead = outputs_of(engines[True], PROMPTS * 3, greedy * 3)
    assert_same(ahead, sync)
    stats = [e.engine.core.get_stats() for e in engines.values()]
    assert all(s.num_preemptions > 0 for s in stats), "the pool was meant to force preemption"
    for llm in engines.values():
        assert_idle(llm)


def test_stop_token_mid_generation_equals_sync(engines):
    first = outputs_of(engines[False], PROMPTS[:1], SamplingParams(temperature=0, max_tokens=20,
                                                                  ignore_eos=True))[0][1][0][0]
    stop_at = first[5]  # a token the greedy run produces: generation ends there
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at])
    results = [outputs_of(engines[m], PROMPTS, params) for m in (False, True)]
    assert_same(results[1], results[0])
    assert results[1][0][1][0][2] == "stop" and len(results[1][0][1][0][0]) <= 6
    for llm in engines.values():
        assert_idle(llm)


def test_seeded_n_and_beam_search_equal_sync(engines):
    params = SamplingParams(n=3, seed=7, temperature=0.8, max_tokens=10, ignore_eos=True)
    assert_same(outputs_of(engines[True], PROMPTS[:2], params), outputs_of(engines[False], PROMPTS[:2], params))
    beams = BeamSearchParams(beam_width=3, max_tokens=8)
    got = [[b.sequences[0].tokens for b in engines[m].beam_search(PROMPTS[:2], beams)] for m in (False, True)]
    assert got[0] == got[1]
    for llm in engines.values():
        assert_idle(llm)


def test_abort_while_a_step_is_scheduled_ahead_frees_everything(engines):
    llm = engines[True]
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"abort-{i}", PROMPTS[i], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.core._pending is not None, "a step should be in flight"
    engine.abort_request(["abort-0", "abort-2"])
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "abort-1"
    assert_idle(llm)
