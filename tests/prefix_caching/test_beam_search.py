"""Beam search equals HF `generate(num_beams=..., length_penalty=..., early_stopping=...,
do_sample=False)`: the same sequences in the same order. Beams share blocks through forks and
leave nothing behind."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from prefix_helpers import BLOCK_SIZE, StepRecorder, assert_drained, make_llm, random_tokens

from kvtide import SamplingParams
from kvtide.models.demo import EOS_ID


@functools.cache
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_beam_search(model_dir: str, prompt: list[int], num_beams: int, max_tokens: int,
                   length_penalty: float, early_stopping, stop_ids: list[int]) -> list[list[int]]:
    """HF's beams, best first, each cut after its first stop token (HF pads the rest)."""
    eos = [EOS_ID] + stop_ids
    with torch.no_grad():
        out = _hf_model(model_dir).generate(
            torch.tensor([prompt]), num_beams=num_beams, num_return_sequences=num_beams,
            max_new_tokens=max_tokens, do_sample=False, length_penalty=length_penalty,
            early_stopping=early_stopping, eos_token_id=eos, pad_token_id=2)
    beams = []
    for row in out.tolist():
        generated = row[len(prompt):]
        ends = [i for i, t in enumerate(generated) if t in eos]
        beams.append(generated[:ends[0] + 1] if ends else generated)
    return beams


CASES = [
    # (seed, beam_width, max_tokens, length_penalty, early_stopping, number of extra stop ids):
    # seeds picked so that some beams finish early and others run to max_tokens.
    (0, 4, 12, 1.0, False, 0),
    (0, 4, 12, 1.0, False, 12),
    (2, 3, 10, 1.0, False, 12),
    (0, 4, 10, -0.5, True, 12),
    (18, 3, 16, 2.0, "never", 24),
    (0, 4, 10, 0.0, False, 16),
    (0, 3, 10, 0.5, "never", 20),
    (2, 4, 10, 1.0, True, 16),
    (6, 1, 8, 1.0, False, 12),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_beam_search_equals_hf(llama_dir, case):
    seed, beam_width, max_tokens, length_penalty, early_stopping, num_stops = CASES[case]
    rng = random.Random(seed)
    prompt = random_tokens(rng, rng.randint(5, 40))
    # Extra stop ids make beams finish early, so the finished-beam rules are exercised.
    stop_ids = rng.sample(range(3, 259), num_stops)
    expected = hf_beam_search(llama_dir, prompt, beam_width, max_tokens, length_penalty,
                              early_stopping, stop_ids)
    llm = make_llm(llama_dir)
    recorder = StepRecorder(llm)
    out = llm.generate([prompt], SamplingParams(
        use_beam_search=True, beam_width=beam_width, n=beam_width, max_tokens=max_tokens,
        length_penalty=length_penalty, early_stopping=early_stopping, stop_token_ids=stop_ids))[0]
    assert [c.token_ids for c in out.outputs] == expected
    for c in out.outputs:
        assert c.finish_reason == ("stop" if c.token_ids[-1] in stop_ids + [EOS_ID] else "length")
        assert c.stop_reason == (c.token_ids[-1] if c.token_ids[-1] in stop_ids else None)
    if beam_width > 1:
        assert recorder.block_copies > 0  # beams forked and copied shared partial blocks
    assert_drained(llm)


def test_beam_search_equals_hf_on_qwen2(checkpoint_factory):
    model_dir = checkpoint_factory("Qwen2ForCausalLM", seed=3)
    rng = random.Random(42)
    prompt = random_tokens(rng, 23)
    stop_ids = rng.sample(range(3, 259), 10)
    expected = hf_beam_search(model_dir, prompt, 3, 12, 1.0, False, stop_ids)
    llm = make_llm(model_dir)
    out = llm.generate([prompt], SamplingParams(use_beam_search=True, beam_width=3, n=3, max_tokens=12,
                                                stop_token_ids=stop_ids))[0]
    assert [c.token_ids for c in out.outputs] == expected


def test_n_best_of_the_beams_scores_and_logprobs(llama_dir):
    prompt = random_tokens(random.Random(3), 30)
    llm = make_llm(llama_dir)
    full = llm.generate([prompt], SamplingParams(use_beam_search=True, beam_width=4, n=4, max_tokens=8))[0]
    top2 = llm.generate([prompt], SamplingParams(use_beam_search=True, beam_width=4, n=2, max_tokens=8,
                                                 logprobs=2))[0]
    assert [c.token_ids for c in top2.outputs] == [c.token_ids for c in full.outputs[:2]]
    for c in top2.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        chosen = [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert c.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-4)
        assert all(len(entry) <= 3 for entry in c.logprobs)
    scores = [c.cumulative_logprob / len(c.token_ids) for c in full.outputs]  # length_penalty 1
    assert scores == sorted(scores, reverse=True)
    assert top2.num_cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_beams_share_the_prompt_blocks(llama_dir):
    """Four beams over a 200-token prompt hold little more than the prompt's blocks."""
    prompt = random_tokens(random.Random(4), 200)
    llm = make_llm(llama_dir, enable_prefix_caching=False)
    recorder = StepRecorder(llm)
    llm.generate([prompt], SamplingParams(use_beam_search=True, beam_width=4, max_tokens=20))
    prompt_blocks = -(-200 // BLOCK_SIZE)
    assert recorder.peak_used_blocks <= prompt_blocks + 4 * 2
    assert_drained(llm)


def test_abort_beam_search_mid_way(llama_dir):
    llm = make_llm(llama_dir)
    engine = llm.engine
    engine.add_request("b", random_tokens(random.Random(5), 50),
                       SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=30))
    for _ in range(5):
        assert engine.step() == []
    assert engine.core.get_stats().num_running == 3
    engine.abort_request(["b"])
    assert not engine.has_unfinished_requests()
    assert_drained(llm)


def test_beam_search_batch_mixed_with_sampling(llama_dir):
    """Beam groups and ordinary requests in the same batches do not disturb each other."""
    rng = random.Random(6)
    prompts = [random_tokens(rng, 20 + 7 * i) for i in range(4)]
    beam = SamplingParams(use_beam_search=True, beam_width=3, n=3, max_tokens=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = make_llm(llama_dir)
    alone = [llm.generate([p], beam if i % 2 else greedy)[0] for i, p in enumerate(prompts)]
    together = llm.generate(prompts, [beam if i % 2 else greedy for i in range(4)])
    assert [[c.token_ids for c in o.outputs] for o in together] == \
        [[c.token_ids for c in o.outputs] for o in alone]
    assert_drained(llm)


@pytest.mark.parametrize("kwargs, match", [
    (dict(stop=["x"]), "stop"),
    (dict(best_of=4), "best_of"),
    (dict(repetition_penalty=1.2), "repetition_penalty"),
    (dict(n=3, beam_width=2), "beam_width"),
    (dict(early_stopping="sometimes"), "early_stopping"),
])
def test_beam_search_rejects_what_it_cannot_honour(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(use_beam_search=True, **kwargs)


def test_llm_beam_search_entry_point(llama_dir):
    """vLLM's `LLM.beam_search(prompts, BeamSearchParams)` runs the same search."""
    from kvtide.sampling_params import BeamSearchParams

    prompts = [random_tokens(random.Random(7 + i), 25) for i in range(2)]
    llm = make_llm(llama_dir)
    results = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=6))
    direct = llm.generate(prompts, SamplingParams(use_beam_search=True, beam_width=3, n=3, max_tokens=6))
    for result, prompt, out in zip(results, prompts, direct, strict=True):
        assert [s.tokens for s in result.sequences] == [prompt + c.token_ids for c in out.outputs]
        # The second run finds the prompt in the prefix cache and attends its tail through another
        # kernel than the first run's prefill: the same tokens, logprobs equal to rounding.
        assert [s.cum_logprob for s in result.sequences] == \
            pytest.approx([c.cumulative_logprob for c in out.outputs], abs=1e-4)
        assert all(s.text is not None for s in result.sequences)
    with pytest.raises(ValueError, match="temperature"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5))


def test_beam_search_under_memory_pressure(llama_dir):
    """Two groups of 4 beams in a 10-block cache: beams are preempted, reported beams that wait on
    them get parked (blocks freed), their children restart from the prefix cache, and the result
    still equals HF's."""
    rng = random.Random(8)
    prompts = [random_tokens(rng, 40) for _ in range(2)]
    expected = [hf_beam_search(llama_dir, p, 4, 30, 1.0, False, []) for p in prompts]
    bytes_per_block = 2 * BLOCK_SIZE * 2 * 32 * 4 * 4
    llm = make_llm(llama_dir, kv_cache_memory=str(10 * bytes_per_block), max_model_len=128)
    outputs = llm.generate(prompts, SamplingParams(use_beam_search=True, beam_width=4, n=4, max_tokens=30))
    assert llm.engine.core.get_stats().num_preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in outputs] == expected
    assert_drained(llm)
