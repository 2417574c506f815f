"""Structured output with the rest of the engine: jump-forward, n > 1, stop strings, max_tokens,
prefix caching, preemption, async scheduling, speculative decoding and logprobs. Constrained greedy
decoding is deterministic, so most tests compare outputs across engine settings; all check that the
output satisfies the constraint and that no KV block leaks."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvtide import LLM, SamplingParams
from kvtide.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                   "unit": {"enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 14},
                   "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"},
                            "maxItems": 2}},
    "required": ["city", "unit", "days", "tags"],
}
JSON = StructuredOutputsParams(json=SCHEMA)
PROMPTS = ["Weather:", "The forecast for tomorrow", "abc abc abc abc", "1 2 3 4 5 6 7 8"]


def make_llm(model_dir: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", "24MiB")
    return LLM(model_dir, device="cpu", dtype="float32", max_model_len=384, **kwargs)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=kwargs.pop("max_tokens", 300), structured_outputs=JSON, **kwargs)


def texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def assert_valid(outputs) -> None:
    for out in outputs:
        for completion in out.outputs:
            assert completion.finish_reason == "stop", completion
            jsonschema.validate(json.loads(completion.text), SCHEMA)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return make_llm(llama_dir)


@pytest.fixture(scope="module")
def reference(llama_dir):
    """Plain constrained decoding: no jump-forward, no prefix caching."""
    llm = make_llm(llama_dir, enable_prefix_caching=False, structured_outputs_config={"enable_jump_forward": False})
    outputs = llm.generate(PROMPTS, greedy())
    assert_valid(outputs)
    return texts(outputs), llm.engine.core.num_steps


def test_jump_forward_gives_the_same_text_in_fewer_forward_passes(llm, reference):
    ref_texts, ref_steps = reference
    steps = llm.engine.core.num_steps
    outputs = llm.generate(PROMPTS, greedy())
    assert texts(outputs) == ref_texts
    stats = llm.engine.core.get_stats().structured_output
    assert stats["num_jump_forward_tokens"] > 0
    assert llm.engine.core.num_steps - steps < ref_steps
    llm.engine.core.check_integrity()


def test_prefix_cache_hit_keeps_the_output(llm, reference):
    first = llm.generate(PROMPTS[:1], greedy())
    again = llm.generate(PROMPTS[:1], greedy())
    assert texts(first) == texts(again) == reference[0][:1]
    assert again[0].num_cached_tokens > 0 or len(again[0].prompt_token_ids) < 16


def test_preemption_replays_nothing_and_changes_nothing(llama_dir, reference):
    small = make_llm(llama_dir, kv_cache_memory="800KiB", block_size=16, enable_prefix_caching=False)
    outputs = small.generate(PROMPTS, greedy())
    assert small.engine.core.get_stats().num_preemptions > 0
    assert texts(outputs) == reference[0]
    small.engine.core.check_integrity()


def test_async_scheduling_gives_the_same_text(llama_dir, reference):
    outputs = make_llm(llama_dir, async_scheduling=True).generate(PROMPTS, greedy())
    assert texts(outputs) == reference[0]


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 2, "adaptive": False},
], ids=["ngram", "layer_skip"])
def test_speculative_decoding_keeps_greedy_constrained_output(llama_dir, reference, spec):
    """Drafts the grammar forbids are cut before verification; what is accepted is what plain
    constrained decoding emits."""
    llm = make_llm(llama_dir, speculative_config={"disable_by_batch_size": 64, **spec})
    outputs = llm.generate(PROMPTS, greedy())
    assert texts(outputs) == reference[0]
    assert llm.engine.core.get_stats().spec_decoding["num_draft_tokens"] > 0
    llm.engine.core.check_integrity()


def test_draft_model_samples_stay_valid(llama_dir, checkpoint_factory):
    """Sampled drafts from a draft model are verified by rejection sampling against the masked
    target distribution: a forbidden draft has probability zero there."""
    draft = checkpoint_factory("LlamaForCausalLM", seed=0, num_hidden_layers=2)
    llm = make_llm(llama_dir, speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                                  "model": draft, "adaptive": False, "disable_by_batch_size": 64})
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=300, structured_outputs=JSON) for s in range(8)]
    outputs = llm.generate([f"Ask {s}" for s in range(8)], params)
    assert_valid(outputs)
    assert llm.engine.core.get_stats().spec_decoding["num_draft_tokens"] > 0
    llm.engine.core.check_integrity()


def test_n_samples_each_follow_the_grammar(llm):
    outputs = llm.generate(["Pick:"], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=300,
                                                      structured_outputs=JSON))
    assert len(outputs[0].outputs) == 4
    assert_valid(outputs)
    assert len({c.text for c in outputs[0].outputs}) > 1


def test_max_tokens_truncates_with_finish_reason_length(llm):
    out = llm.generate(["Weather:"], greedy(max_tokens=6))[0].outputs[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 6
    assert out.text.startswith("{")


def test_stop_string_applies_inside_the_grammar(llm):
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=50, stop=["-"],
                            structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2}-[0-9]{2}"))
    out = llm.generate(["x"], params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "-"
    assert re.fullmatch("[a-z]{2}", out.text)


def test_logprobs_come_from_the_constrained_distribution(llm):
    """With logprobs every token is decoded (no jump-forward) and the alternatives reported are
    the ones the grammar allows."""
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=5,
                            structured_outputs=StructuredOutputsParams(regex="[0-9]{4}"))
    out = llm.generate(["Digits:"], params)[0].outputs[0]
    assert re.fullmatch("[0-9]{4}", out.text) and len(out.logprobs) == len(out.token_ids) == 5  # + EOS
    tokenizer = llm.get_tokenizer()
    for token, entry in zip(out.token_ids[:4], out.logprobs[:4], strict=True):
        assert max(entry.values(), key=lambda e: e.logprob) is entry[token]
        assert all(tokenizer.decode([t]).isdigit() for t in entry), entry
        assert sum(pow(2.718281828459045, e.logprob) for e in entry.values()) <= 1 + 1e-5


def test_reasoning_section_is_free_and_the_answer_constrained(llm):
    """The grammar sleeps until the output holds the reasoning end sequence (here one token,
    forced by a logit bias; the bias cannot lift a masked token afterwards)."""
    tokenizer = llm.get_tokenizer()
    end = tokenizer.encode("#", add_special_tokens=False)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, logit_bias={end[0]: 100.0},
                            structured_outputs=StructuredOutputsParams(regex="[0-9]{3}", reasoning_end_token_ids=end))
    out = llm.generate(["Think:"], params)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert re.fullmatch("#[0-9]{3}", out.text), out.text


@pytest.mark.parametrize("constraint, match", [
    ({"json": {"type": "objectx"}}, "structured_outputs.json: Unsupported type"),
    ({"regex": "a(b"}, "structured_outputs.regex: .*parenthesis"),
    ({"grammar": "root ::= missing"}, "structured_outputs.grammar: .*not defined"),
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one of"),
    ({"choice": []}, "non-empty list"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"whitespace_pattern": " *", "json_object": True}, "whitespace_pattern"),
])
def test_bad_constraints_are_value_errors_before_anything_runs(llm, constraint, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=constraint))
    assert not llm.engine.core.has_unfinished_requests()
    llm.engine.core.check_integrity()


def test_beam_search_keeps_every_beam_in_the_grammar(llm):
    """Each beam forks its parent's matcher: all n returned sequences satisfy the constraint, come
    best first, and differ."""
    pattern = r"(cat|dog|cow)-[0-9]{2}"
    params = SamplingParams(n=3, use_beam_search=True, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    out = llm.generate(["Animal:"], params)[0]
    assert len(out.outputs) == 3
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        assert re.fullmatch(pattern, completion.text), completion.text
    assert len({c.text for c in out.outputs}) == 3
    scores = [c.cumulative_logprob / len(c.token_ids) for c in out.outputs]
    assert scores == sorted(scores, reverse=True)
    llm.engine.core.check_integrity()


def test_beam_search_with_a_schema(llm):
    params = SamplingParams(n=2, use_beam_search=True, max_tokens=120, structured_outputs=JSON)
    assert_valid(llm.generate(["Weather:"], params))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_extreme_penalties_never_pick_a_masked_token(llm, temperature):
    """A repetition penalty of 5e-324 divides positive logits to +inf; the draw must still land on
    a token the grammar allows (found by the API fuzzer)."""
    params = SamplingParams(temperature=temperature, seed=0, top_k=34, max_tokens=4, repetition_penalty=5e-324,
                            presence_penalty=5e-324, structured_outputs=StructuredOutputsParams(regex="×\U0003f433\x95"))
    out = llm.generate(["×\U0003f433\x95"], params)[0].outputs[0]
    assert out.finish_reason == "length"
    forced = llm.get_tokenizer().encode("×\U0003f433\x95", add_special_tokens=False)
    assert out.token_ids == forced[:4]


def test_min_tokens_yields_to_a_grammar_that_only_allows_the_end(llm):
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=20, min_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.generate(["Answer:"], params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no")
