"""Sampling through LLM.generate: n > 1, seeds whatever the batch, stop strings and stop ids, and
streaming (DELTA) equal to the final output."""

from __future__ import annotations

import pytest

from kvtide import LLM, SamplingParams
from kvtide.engine.output_processor import RequestOutputKind

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(model=llama_dir, kv_cache_memory="32MiB", max_model_len=256)


def assert_idle(llm) -> None:
    assert not llm.engine.has_unfinished_requests()
    llm.engine.core.check_integrity()
    assert llm.engine.core.scheduler.kv_cache_manager.pool.num_used_blocks == 0


def test_n_seeded_equals_single_requests_with_seed_plus_index(llm):
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate(PROMPT, params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    singles = llm.generate([PROMPT] * 3, [params.clone(n=1, seed=11 + i) for i in range(3)])
    for i, single in enumerate(singles):
        assert out.outputs[i].token_ids == single.outputs[0].token_ids
        assert out.outputs[i].text == single.outputs[0].text
        assert len(single.outputs[0].token_ids) == 8
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # three different samples
    assert_idle(llm)


def test_n_unseeded_returns_n_completions(llm):
    outs = llm.generate([PROMPT, "hi"], SamplingParams(n=4, temperature=1.0, max_tokens=4))
    for out in outs:
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        assert all(c.finish_reason in ("length", "stop") for c in out.outputs)
    assert_idle(llm)


def test_seeded_request_same_alone_and_in_a_batch(llm):
    seeded = SamplingParams(seed=5, temperature=0.9, top_k=50, max_tokens=6)
    alone = llm.generate(PROMPT, seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.2, max_tokens=3), SamplingParams(temperature=0.0, max_tokens=7),
              SamplingParams(seed=1, max_tokens=3, top_p=0.5)]
    prompts = ["a", [5, 6, 7, 8], PROMPT, "another prompt"]
    params = others[:2] + [seeded] + others[2:]
    batch = llm.generate(prompts, params)
    assert batch[2].outputs[0].token_ids == alone
    assert_idle(llm)


def test_stop_string_and_stop_token_end_generation(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = llm.generate(PROMPT, greedy)[0].outputs[0]
    text = full.text
    start = next(i for i in range(3, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]
    cut = text.find(stop)
    out = llm.generate(PROMPT, greedy.clone(stop=[stop]))[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:cut], "stop", stop)
    assert full.token_ids[:len(out.token_ids)] == out.token_ids
    assert len(out.token_ids) < len(full.token_ids)
    out = llm.generate(PROMPT, greedy.clone(stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert out.text == text[:cut + len(stop)]
    assert_idle(llm)

    stop_id = full.token_ids[6]
    first = full.token_ids.index(stop_id)
    out = llm.generate(PROMPT, greedy.clone(stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == full.token_ids[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert_idle(llm)


def test_streaming_deltas_add_up_to_the_final_output(llm):
    engine = llm.engine
    params = SamplingParams(seed=3, temperature=1.0, max_tokens=20, n=2, logprobs=2)
    final = llm.generate(PROMPT, params)[0]
    engine.add_request("stream", PROMPT, params, output_kind=RequestOutputKind.DELTA)
    texts, tokens, logprobs = ["", ""], [[], []], [[], []]
    finished = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                texts[c.index] += c.text
                tokens[c.index] += c.token_ids
                logprobs[c.index] += c.logprobs
            finished = out.finished
    assert finished
    for i, c in enumerate(final.outputs):
        assert (texts[i], tokens[i]) == (c.text, c.token_ids)
        assert [lp.keys() for lp in logprobs[i]] == [lp.keys() for lp in c.logprobs]
        assert len(c.logprobs) == len(c.token_ids)
        assert all(c.token_ids[j] in c.logprobs[j] for j in range(len(c.token_ids)))
        assert c.cumulative_logprob == pytest.approx(
            sum(c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)), abs=1e-4)
    assert_idle(llm)


def test_min_tokens_and_ignore_eos_with_eos_forced(llm):
    eos = llm.model_info.eos_token_ids[0]
    forced = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={eos: 100.0})
    out = llm.generate(PROMPT, forced)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason is None
    out = llm.generate(PROMPT, forced.clone(min_tokens=5))[0].outputs[0]
    assert len(out.token_ids) == 6 and eos not in out.token_ids[:5] and out.token_ids[5] == eos
    out = llm.generate(PROMPT, forced.clone(ignore_eos=True))[0].outputs[0]
    assert out.token_ids == [eos] * 8 and out.finish_reason == "length"
    assert_idle(llm)


def test_non_finite_logits_fail_only_that_request_with_a_warning(llm, monkeypatch, caplog):
    """Offline, a request whose logits turn NaN ends with finish_reason 'abort' and a logged
    warning that says why; its batch neighbours finish normally and no block leaks."""
    import kvtide.worker.model_runner as model_runner
    from kvtide.testing.faults import FaultInjector

    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = llm.generate(["healthy one", "healthy two"], greedy)
    monkeypatch.setattr(model_runner, "FAULTS", FaultInjector(nan_token=77))
    with caplog.at_level("WARNING", logger="kvtide.engine.llm_engine"):
        outs = llm.generate(["healthy one", [5, 77, 6], "healthy two"], greedy)
    assert outs[1].outputs[0].finish_reason == "abort" and outs[1].outputs[0].token_ids == []
    for out, ref in zip((outs[0], outs[2]), expected, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].finish_reason == "length"
    assert any("non-finite logits" in r.getMessage() and "abort" in r.getMessage() for r in caplog.records)
    assert_idle(llm)
