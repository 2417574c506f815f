"""prompt_logprobs_start: prompt logprobs from one position on, with the prefix cache serving the
full blocks before it; the positions computed give the logprobs a full computation gives."""

from __future__ import annotations

import pytest

from kvtide import LLM, SamplingParams

BLOCK_SIZE = 16
PREFIX = list(range(3, 3 + 45))  # byte-tokenizer ids: 45 prompt tokens
CONTINUATION = [60, 61, 62, 63, 64]


@pytest.fixture(scope="module")
def llm(llama_dir):
    llm = LLM(llama_dir, device="cpu", dtype="float32", max_model_len=256, block_size=BLOCK_SIZE,
              kv_cache_memory="8MiB")
    yield llm
    llm.shutdown()


def test_cached_prefix_then_logprobs_from_the_start_position(llm):
    llm.reset_prefix_cache()
    full = llm.generate({"prompt_token_ids": PREFIX + CONTINUATION},
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))[0]
    assert full.num_cached_tokens == 0
    llm.generate({"prompt_token_ids": PREFIX}, SamplingParams(max_tokens=1, temperature=0.0))  # cache it
    start = len(PREFIX)
    scored = llm.generate({"prompt_token_ids": PREFIX + CONTINUATION},
                          SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2,
                                         prompt_logprobs_start=start))[0]
    hit = (start - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert scored.num_cached_tokens == hit == 32
    entries = scored.prompt_logprobs
    assert len(entries) == len(PREFIX + CONTINUATION)
    assert entries[:hit + 1] == [None] * (hit + 1)
    for position in range(hit + 1, len(entries)):
        assert entries[position].keys() == full.prompt_logprobs[position].keys()
        for token_id, logprob in entries[position].items():
            assert logprob.logprob == pytest.approx(full.prompt_logprobs[position][token_id].logprob, abs=1e-4)
            assert logprob.rank == full.prompt_logprobs[position][token_id].rank


def test_without_a_start_the_prompt_is_computed_in_full(llm):
    llm.generate({"prompt_token_ids": PREFIX}, SamplingParams(max_tokens=1, temperature=0.0))
    out = llm.generate({"prompt_token_ids": PREFIX + CONTINUATION},
                       SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0
    assert out.prompt_logprobs[0] is None and all(e is not None for e in out.prompt_logprobs[1:])


@pytest.mark.parametrize("kwargs", [{"prompt_logprobs_start": 3}, {"prompt_logprobs": 0, "prompt_logprobs_start": 0},
                                    {"prompt_logprobs": 0, "prompt_logprobs_start": 2.0}])
def test_bad_starts_are_refused(kwargs):
    with pytest.raises(ValueError, match="prompt_logprobs_start"):
        SamplingParams(**kwargs)


def test_preempted_requests_keep_their_prompt_logprobs(llama_dir, llm):
    """Chunked prefills in a KV cache of 10 blocks: requests are preempted and resumed, and every
    position from the start on still gets the logprob a roomy engine computes."""
    prompts = [PREFIX + [60 + i + j % 7 for j in range(70)] for i in range(6)]
    reference = llm.generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=0, ignore_eos=True))
    small = LLM(llama_dir, device="cpu", dtype="float32", max_model_len=160, block_size=BLOCK_SIZE,
                kv_cache_memory="320KiB", max_num_batched_tokens=32, max_num_seqs=6)
    try:
        outputs = small.generate([{"prompt_token_ids": p} for p in prompts],
                                 SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=0,
                                                prompt_logprobs_start=len(PREFIX), ignore_eos=True))
        assert small.engine.core.get_stats().num_preemptions > 0
        for out, ref in zip(outputs, reference, strict=True):
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
            assert len(out.prompt_logprobs) == len(ref.prompt_logprobs)
            for position in range(len(PREFIX), len(prompts[0])):
                token_id = out.prompt_token_ids[position]
                assert out.prompt_logprobs[position][token_id].logprob == pytest.approx(
                    ref.prompt_logprobs[position][token_id].logprob, abs=1e-4)
        small.engine.core.check_integrity()
    finally:
        small.shutdown()
