"""The engine's features run per adapter: a LoRA request gives what the same request gives on a
checkpoint with its adapter merged in (served by kvtide as a plain model), for n > 1, beam search,
stop strings, structured output, n-gram speculation and prompt logprobs."""

from __future__ import annotations

import pytest
from hf_reference import assert_greedy_and_logprobs_match_hf

from kvtide import LLM, LoRARequest, SamplingParams
from kvtide.sampling_params import BeamSearchParams, StructuredOutputsParams

NAME = "all-r16-rslora"
PROMPTS = ["the cache holds blocks of keys and values", "seven quantum lattice ember"]
MAX_TOKENS = 8


def make_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory="8MiB", **kwargs)


@pytest.fixture(scope="module")
def engines(lora_case_factory):
    """(case, the base with LoRA on, the merged checkpoint as a plain model, the adapter)."""
    case = lora_case_factory("LlamaForCausalLM")
    with_lora = make_llm(case.base_dir, enable_lora=True, max_lora_rank=16)
    merged = make_llm(case.merged_dirs[NAME])
    yield case, with_lora, merged, LoRARequest(NAME, 1, case.adapter_dirs[NAME])
    with_lora.shutdown()
    merged.shutdown()


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


def test_n_samples_and_stop_strings(engines):
    case, with_lora, merged, lora = engines
    params = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = with_lora.generate(PROMPTS, params, lora_request=lora)
    assert token_ids(got) == token_ids(merged.generate(PROMPTS, params))
    text = merged.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    stop = text[0].outputs[0].text[3:5]
    stopped = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])
    got = with_lora.generate(PROMPTS[:1], stopped, lora_request=lora)[0].outputs[0]
    assert got.text == merged.generate(PROMPTS[:1], stopped)[0].outputs[0].text and got.finish_reason == "stop"


def test_beam_search(engines):
    case, with_lora, merged, lora = engines
    params = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    got = with_lora.beam_search(PROMPTS, params, lora_request=lora)
    expected = merged.beam_search(PROMPTS, params)
    assert [[s.tokens for s in o.sequences] for o in got] == [[s.tokens for s in o.sequences] for o in expected]


def test_structured_output(engines):
    case, with_lora, merged, lora = engines
    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(
        regex="[a-z]{3,8} [a-z]{3,8}"))
    got = with_lora.generate(PROMPTS, params, lora_request=lora)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in merged.generate(PROMPTS, params)]


def test_prompt_logprobs(engines):
    case, with_lora, merged, lora = engines
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    got = with_lora.generate(PROMPTS[:1], params, lora_request=lora)[0].prompt_logprobs
    expected = merged.generate(PROMPTS[:1], params)[0].prompt_logprobs
    assert len(got) == len(expected) and got[0] is None
    for mine, theirs in zip(got[1:], expected[1:], strict=True):
        (token, entry), = ((t, e) for t, e in mine.items() if t in theirs)
        assert entry.logprob == pytest.approx(theirs[token].logprob, abs=1e-4)


def test_ngram_speculation(lora_case_factory):
    case = lora_case_factory("LlamaForCausalLM")
    llm = make_llm(case.base_dir, enable_lora=True, max_lora_rank=16, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    try:
        prompts = ["abc abc abc abc abc abc", PROMPTS[0]]
        names = [NAME, None]
        requests = [LoRARequest(NAME, 1, case.adapter_dirs[NAME]), None]
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
        outputs = llm.generate(prompts, params, lora_request=requests)
        for prompt, name, out in zip(prompts, names, outputs, strict=True):
            reference = case.merged_dirs[name] if name else case.base_dir
            assert_greedy_and_logprobs_match_hf(reference, [prompt], [out], MAX_TOKENS, 1e-4)
        assert llm.engine.core.scheduler.spec_stats.as_dict()["num_draft_tokens"] > 0
    finally:
        llm.shutdown()


def test_float_adapter_over_an_int8_base(engines):
    """QLoRA-style serving: the base weights int8, the adapter in float. Its rows stay what they are
    alone when batched with base rows, base rows stay the int8 model's, and the adapter matters."""
    case, _, _, lora = engines
    llm = make_llm(case.base_dir, quantization="int8", enable_lora=True, max_lora_rank=16)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
        mixed = llm.generate(PROMPTS + PROMPTS, greedy, lora_request=[lora, lora, None, None])
        alone = llm.generate(PROMPTS, greedy, lora_request=lora)
        base = llm.generate(PROMPTS, greedy)
        assert token_ids(mixed[:2]) == token_ids(alone)
        assert token_ids(mixed[2:]) == token_ids(base) != token_ids(alone)
    finally:
        llm.shutdown()
