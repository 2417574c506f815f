"""Bad input through LLM.generate: a ValueError naming the parameter, raised before any engine state
changes, after which the engine still generates the same tokens."""

from __future__ import annotations

import shutil

import pytest
from checkpoint_edits import set_architecture

from kvtide import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
GOOD_PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(model=llama_dir, kv_cache_memory="32MiB", max_model_len=256)


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy tokens of GOOD_PROMPT, taken before any bad input."""
    return llm.generate(GOOD_PROMPT, GREEDY)[0].outputs[0].token_ids


def assert_untouched(llm) -> None:
    core = llm.engine.core
    assert not core.scheduler.requests
    assert not core.scheduler.has_unfinished_requests()
    assert not llm.engine.output_processor.requests
    assert not llm.engine.output_processor._child_to_parent
    assert not llm.engine.has_unfinished_requests()
    core.check_integrity()
    assert core.scheduler.kv_cache_manager.pool.num_used_blocks == 0


def assert_rejected(llm, prompts, params=GREEDY, match: str | None = None) -> str:
    with pytest.raises(ValueError, match=match) as info:
        llm.generate(prompts, params)
    assert_untouched(llm)
    return str(info.value)


def assert_still_generates(llm, reference) -> None:
    assert llm.generate(GOOD_PROMPT, GREEDY)[0].outputs[0].token_ids == reference
    assert_untouched(llm)


V = 259  # the byte tokenizer: 3 special tokens + 256 bytes


def test_prompt_longer_than_max_model_len(llm, reference):
    for prompt in ["x" * 300,  # 301 tokens with BOS
                   "x" * 255,  # 256 tokens == max_model_len: no room to generate
                   list(range(3, 259)), {"prompt_token_ids": [5] * 1000}, {"prompt": "y" * 400}]:
        message = assert_rejected(llm, prompt)
        assert "max_model_len=256" in message and "prompt" in message
    assert_still_generates(llm, reference)


def test_empty_prompt(llm, reference):
    for prompt in ["", [], {"prompt_token_ids": []}, {"prompt": ""}, [[]], [""]]:
        message = assert_rejected(llm, prompt)
        assert message.startswith("prompt") and "empty" in message, (prompt, message)
    assert_still_generates(llm, reference)


def test_token_ids_outside_vocabulary(llm, reference):
    for prompt in [[5, V], [-1, 5], [5, 10**9], {"prompt_token_ids": [3, 4, 2**40]}, [[3, 4], [V + 1]]]:
        message = assert_rejected(llm, prompt, match="prompt_token_ids")
        assert f"[0, {V})" in message
    assert_still_generates(llm, reference)


def test_malformed_prompt(llm, reference):
    for prompt in [[1.5, 3], [["a", "b"]], [True, 5], 42, b"bytes", {"text": "x"}, [None],
                   {"prompt_token_ids": 5}, {"prompt_token_ids": None}, {"prompt_token_ids": "abc"},
                   {"prompt": 5}]:
        message = assert_rejected(llm, prompt)
        assert "prompt" in message, (prompt, message)
    assert_still_generates(llm, reference)


def test_bad_item_in_batch_of_good_prompts(llm, reference):
    for bad in ["", [], [7, V], "z" * 400, {"prompt_token_ids": [1, -3]}]:
        for position in (0, 2, 4):
            prompts: list = ["hello", [5, 6, 7], {"prompt": "world"}, {"prompt_token_ids": [9, 10]}]
            prompts.insert(position, bad)
            assert_rejected(llm, prompts)
    assert_still_generates(llm, reference)


def test_params_outside_vocabulary(llm, reference):
    for params, name in [(SamplingParams(logit_bias={V: 1.0}), "logit_bias"),
                         (SamplingParams(stop_token_ids=[V + 3]), "stop_token_ids")]:
        message = assert_rejected(llm, ["hello", "world"], params)
        assert message.startswith(name) and f"[0, {V})" in message
    assert_still_generates(llm, reference)


def test_bad_params_in_a_list(llm, reference):
    assert_rejected(llm, ["a", "b"], [GREEDY], match="sampling_params")
    assert_rejected(llm, ["a", "b"], [GREEDY, "greedy"], match="sampling_params")
    assert_rejected(llm, ["a", "b"], [GREEDY, SamplingParams(logit_bias={V: 1.0})], match="logit_bias")
    assert_rejected(llm, [], GREEDY, match="prompts")
    assert_still_generates(llm, reference)


def test_late_failure_in_a_batch_rolls_back(llm, reference, monkeypatch):
    """Should the core refuse the third request of a batch (e.g. a full waiting queue), the two
    already queued are taken back."""
    core = llm.engine.core
    original = core.add_request
    calls = []

    def refuse_third(core_request):
        calls.append(core_request.request_id)
        if len(calls) == 3:
            raise ValueError("waiting queue is full (2 requests)")
        original(core_request)

    monkeypatch.setattr(core, "add_request", refuse_third)
    with pytest.raises(ValueError, match="queue is full"):
        llm.generate(["a", "b", "c", "d"], GREEDY)
    monkeypatch.undo()
    assert len(calls) == 3
    assert_untouched(llm)
    assert_still_generates(llm, reference)


def test_late_failure_of_a_sample_rolls_back(llm, reference, monkeypatch):
    """The same within one request of n samples: the samples already queued are taken back."""
    core = llm.engine.core
    original = core.add_request

    def refuse_second_sample(core_request):
        if core_request.request_id.startswith("1_"):
            raise ValueError("waiting queue is full")
        original(core_request)

    monkeypatch.setattr(core, "add_request", refuse_second_sample)
    with pytest.raises(ValueError, match="queue is full"):
        llm.generate(["a", "b"], SamplingParams(n=3, max_tokens=2))
    monkeypatch.undo()
    assert_untouched(llm)
    assert_still_generates(llm, reference)


def test_good_batch_after_failures(llm, reference):
    outs = llm.generate([GOOD_PROMPT, "hello", [5, 6, 7]], GREEDY)
    assert outs[0].outputs[0].token_ids == reference
    assert all(len(o.outputs[0].token_ids) <= 4 for o in outs)
    assert_untouched(llm)


def test_unknown_architecture(llama_dir, tmp_path):
    model_dir = tmp_path / "unknown"
    shutil.copytree(llama_dir, model_dir)
    set_architecture(str(model_dir), "NotARealModelForCausalLM")
    with pytest.raises(ValueError, match="architecture") as info:
        LLM(model=str(model_dir), kv_cache_memory="32MiB", max_model_len=256)
    message = str(info.value)
    assert "NotARealModelForCausalLM" in message and "LlamaForCausalLM" in message


def test_lone_surrogate_prompt_is_a_value_error(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("abc\ud800def", SamplingParams(max_tokens=2))
    assert not llm.engine.output_processor.requests
