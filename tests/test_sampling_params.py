"""SamplingParams: every bad value is a ValueError naming the parameter and its allowed range."""

from __future__ import annotations

import math
import re

import pytest

from kvtide import SamplingParams
from kvtide.sampling_params import SamplingType

NAN, INF = math.nan, math.inf

# (kwargs, parameter name, a fragment of the allowed range that the message must carry)
BAD = [
    (dict(max_tokens=0), "max_tokens", ">= 1"),
    (dict(max_tokens=-5), "max_tokens", ">= 1"),
    (dict(max_tokens=2.5), "max_tokens", ">= 1"),
    (dict(max_tokens=True), "max_tokens", ">= 1"),
    (dict(temperature=-0.1), "temperature", ">= 0"),
    (dict(temperature=NAN), "temperature", ">= 0"),
    (dict(temperature=INF), "temperature", ">= 0"),
    (dict(temperature="1"), "temperature", ">= 0"),
    (dict(top_p=0.0), "top_p", "(0, 1]"),
    (dict(top_p=-0.5), "top_p", "(0, 1]"),
    (dict(top_p=1.0001), "top_p", "(0, 1]"),
    (dict(top_p=NAN), "top_p", "(0, 1]"),
    (dict(top_k=0), "top_k", ">= 1"),
    (dict(top_k=-2), "top_k", ">= 1"),
    (dict(top_k=2.5), "top_k", ">= 1"),
    (dict(top_k=True), "top_k", ">= 1"),
    (dict(n=0), "n", ">= 1"),
    (dict(n=-1), "n", ">= 1"),
    (dict(n=1.0), "n", ">= 1"),
    (dict(n=True), "n", ">= 1"),
    (dict(n=2, best_of=1), "best_of", ">= n"),
    (dict(min_p=-0.01), "min_p", "[0, 1]"),
    (dict(min_p=1.5), "min_p", "[0, 1]"),
    (dict(min_p=NAN), "min_p", "[0, 1]"),
    (dict(presence_penalty=2.5), "presence_penalty", "[-2.0, 2.0]"),
    (dict(presence_penalty=-2.01), "presence_penalty", "[-2.0, 2.0]"),
    (dict(presence_penalty=NAN), "presence_penalty", "[-2.0, 2.0]"),
    (dict(frequency_penalty=3), "frequency_penalty", "[-2.0, 2.0]"),
    (dict(frequency_penalty=-INF), "frequency_penalty", "[-2.0, 2.0]"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "> 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty", "> 0"),
    (dict(repetition_penalty=NAN), "repetition_penalty", "> 0"),
    (dict(repetition_penalty=INF), "repetition_penalty", "> 0"),
    (dict(logprobs=21), "logprobs", "[0, 20]"),
    (dict(logprobs=-1), "logprobs", "[0, 20]"),
    (dict(logprobs=True), "logprobs", "[0, 20]"),
    (dict(prompt_logprobs=21), "prompt_logprobs", "[0, 20]"),
    (dict(prompt_logprobs=1.5), "prompt_logprobs", "[0, 20]"),
    (dict(min_tokens=-1), "min_tokens", ">= 0"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens", "<= max_tokens"),
    (dict(seed=1.5), "seed", "an integer"),
    (dict(seed="7"), "seed", "an integer"),
    (dict(stop=""), "stop", "non-empty strings"),
    (dict(stop=["ok", ""]), "stop", "non-empty strings"),
    (dict(stop=[3]), "stop", "non-empty strings"),
    (dict(stop=5), "stop", "non-empty strings"),
    (dict(stop_token_ids=[-1]), "stop_token_ids", ">= 0"),
    (dict(stop_token_ids=[True]), "stop_token_ids", ">= 0"),
    (dict(stop_token_ids=7), "stop_token_ids", ">= 0"),
    (dict(logit_bias={-1: 1.0}), "logit_bias", "[-100, 100]"),
    (dict(logit_bias={1: 100.5}), "logit_bias", "[-100, 100]"),
    (dict(logit_bias={1: NAN}), "logit_bias", "[-100, 100]"),
    (dict(logit_bias={"abc": 1.0}), "logit_bias", "[-100, 100]"),
    (dict(logit_bias={1.5: 1.0}), "logit_bias", "[-100, 100]"),
    (dict(logit_bias=[1, 2]), "logit_bias", "[-100, 100]"),
    (dict(cache_salt=""), "cache_salt", "non-empty"),
    (dict(kv_transfer_params=[1]), "kv_transfer_params", "an object"),
    (dict(kv_transfer_params={"block": 2**70}), "kv_transfer_params", "at most 64 bits"),
    (dict(kv_transfer_params={"x": object()}), "kv_transfer_params", "JSON values"),
]


# Ids must be the same in every pytest-xdist worker, so no object's address may appear in one.
@pytest.mark.parametrize(
    "kwargs, name, allowed", BAD,
    ids=[re.sub(r" at 0x[0-9a-f]+", "", f"{n}={list(k.values())}") for k, n, _ in BAD],
)
def test_bad_value_names_parameter_and_range(kwargs, name, allowed):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith(f"{name} must be"), message
    assert allowed in message, message


@pytest.mark.parametrize("kwargs", [
    dict(), dict(max_tokens=1), dict(max_tokens=None), dict(temperature=0), dict(temperature=0.0),
    dict(temperature=5.0), dict(top_p=1.0), dict(top_p=1e-6), dict(top_k=-1), dict(top_k=1),
    dict(min_p=0.0), dict(min_p=1.0), dict(presence_penalty=-2.0), dict(frequency_penalty=2.0),
    dict(repetition_penalty=1e-3), dict(logprobs=0), dict(logprobs=20), dict(prompt_logprobs=0),
    dict(min_tokens=4, max_tokens=4), dict(n=3, best_of=5, seed=0), dict(stop="x"),
    dict(stop=("a", "b")), dict(stop_token_ids=(1, 2)), dict(logit_bias={"7": -100, 3: 100}),
    dict(cache_salt="tenant"), dict(kv_transfer_params={"do_remote_decode": True, "ids": [2**63 - 1]}),
])
def test_good_values_accepted(kwargs):
    SamplingParams(**kwargs)


def test_normalization():
    p = SamplingParams(top_k=-1, stop="end", stop_token_ids=(4,), logit_bias={"7": 1, 3: -2})
    assert p.top_k == -1
    assert p.stop == ["end"] and p.stop_token_ids == [4]
    assert p.logit_bias == {7: 1.0, 3: -2.0}
    assert p.all_stop_token_ids == {4}


def test_sampling_type_and_clone():
    assert SamplingParams(temperature=0.0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6).sampling_type == SamplingType.GREEDY
    assert SamplingParams().sampling_type == SamplingType.RANDOM
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    p = SamplingParams(n=2, seed=1, stop=["a"])
    p.all_stop_token_ids = {1}
    c = p.clone(n=1, seed=2, stop_token_ids=[5])
    assert (c.n, c.seed, c.stop) == (1, 2, ["a"]) and c.all_stop_token_ids == {1, 5}
    c.stop.append("b")
    assert p.stop == ["a"]  # the clone shares no lists
    with pytest.raises(ValueError, match="temperature"):
        p.clone(temperature=-1)
    assert SamplingParams(n=2, best_of=4).num_samples == 4 and SamplingParams(n=3).num_samples == 3
