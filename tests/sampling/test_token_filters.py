"""bad_words, allowed_token_ids and truncate_prompt_tokens through LLM.generate, and their bad
values refused with ValueError before anything is queued."""

from __future__ import annotations

import pytest
from torch_threads import one_torch_thread

from kvtide import LLM, SamplingParams
from kvtide.sampling.ops import banned_bad_word_tokens

PROMPT = "Once upon a time"


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(model=llama_dir, kv_cache_memory="32MiB", max_model_len=256)


def test_banned_tokens_complete_a_word_only_after_its_prefix():
    words = [[7], [1, 2, 3], [5, 9]]
    assert banned_bad_word_tokens(words, []) == [7]
    assert banned_bad_word_tokens(words, [4, 1, 2]) == [7, 3]
    assert banned_bad_word_tokens(words, [1, 2, 5]) == [7, 9]
    assert banned_bad_word_tokens(words, [2, 1]) == [7]


def test_bad_words_never_appear_in_200_samples_that_would_hold_them(llm):
    # The greedy continuation repeats one digit; a prompt ending just before it makes the samples
    # at temperature 0.5 hold that digit twice in a row most of the time.
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    text = greedy.outputs[0].text
    word = next(text[i:i + 2] for i in range(len(text) - 1) if text[i].isdigit() and text[i + 1] == text[i])
    start = next(i for i, t in enumerate(greedy.outputs[0].token_ids) if llm.tokenizer.decode([t]) == word[0])
    prompt = {"prompt_token_ids": greedy.prompt_token_ids + greedy.outputs[0].token_ids[:start]}
    params = SamplingParams(n=200, temperature=0.5, max_tokens=8, ignore_eos=True, seed=3)
    free = llm.generate(prompt, params)[0].outputs
    assert sum(word in c.text for c in free) >= 100
    banned = llm.generate(prompt, params.clone(bad_words=[word]))[0].outputs
    assert len(banned) == 200 and not any(word in c.text for c in banned)
    assert sum(word[0] in c.text for c in banned) >= 100  # the word's first token alone is still allowed


def test_allowed_token_ids_restrict_every_sample(llm):
    allowed = llm.tokenizer.encode("xyz", add_special_tokens=False)
    outs = llm.generate(PROMPT, SamplingParams(n=16, temperature=1.0, max_tokens=8, ignore_eos=True,
                                               allowed_token_ids=allowed, seed=1))[0].outputs
    assert all(set(c.token_ids) <= set(allowed) for c in outs)
    assert len({t for c in outs for t in c.token_ids}) > 1  # sampled among them, not one forced token


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    cut = llm.generate(PROMPT, params.clone(truncate_prompt_tokens=4))[0]
    assert cut.prompt_token_ids == ids[-4:]
    assert cut.outputs[0].token_ids == llm.generate({"prompt_token_ids": ids[-4:]}, params)[0].outputs[0].token_ids
    long_ids = (ids * 40)[:300]  # longer than max_model_len: -1 keeps what leaves room for one token
    out = llm.generate({"prompt_token_ids": long_ids}, params.clone(max_tokens=1, truncate_prompt_tokens=-1))[0]
    assert out.prompt_token_ids == long_ids[-255:] and len(out.outputs[0].token_ids) == 1


@pytest.mark.parametrize("kwargs, name", [
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-3]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1.5]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(bad_words=[3]), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(extra_args={"x": object()}), "extra_args"),
])
def test_bad_values_raise_at_construction(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_out_of_vocabulary_ids_are_refused_before_anything_is_queued(llm):
    ok = SamplingParams(max_tokens=2)
    for bad in (SamplingParams(allowed_token_ids=[1, 10**6]), SamplingParams(max_tokens=1, bad_words=["ok"],
                                                                              allowed_token_ids=[llm.model_info.vocab_size])):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            llm.generate([PROMPT, PROMPT], [ok, bad])
        assert not llm.engine.has_unfinished_requests()
