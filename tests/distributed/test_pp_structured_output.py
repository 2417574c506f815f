"""Structured output on pipeline-parallel replicas (real worker processes, gloo, one thread per
rank): the engine core computes each step's draft cut and token bitmask ahead of the step and
ships them to the last stage, which samples (structured_output/step.py StepBitmask).

Against world size 1, in one batch of constrained and free requests: JSON schema (with
jump-forward), regex (one asking for logprobs, so decoded token by token), choice, a grammar gated
by a reasoning section, and free greedy requests give the same tokens at PP=2, and TP=2 x PP=1 (the
in-process masks); each constrained output is valid. With n-gram speculation on a checkpoint that
loops, PP=2 and TP=2 x PP=2 cut exactly the drafts world size 1 cuts, accept the same, and emit
the same tokens. A grammar that does not compile is still a ValueError.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

import jsonschema
import pytest

from kvtide import LLM, SamplingParams
from kvtide.sampling_params import StructuredOutputsParams
from kvtide.structured_output.step import GrammarStep

MAX_MODEL_LEN = 256
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}}, "required": ["name", "n", "ok"]}
REGEX = "(ab|ac|b)+c"
CODE = "[0-9]{3}-[a-z]{2}"
CHOICES = ["yes", "no", "maybe so"]
GATED_TAIL = "(x|y)+z"
FREE = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def constrained(max_tokens: int, logprobs: int | None = None, **constraint) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=logprobs,
                          structured_outputs=StructuredOutputsParams(**constraint))


def make_llm(model_dir: str, spec: dict | None = None, **parallel) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory="4MiB",
               enable_prefix_caching=False, speculative_config=spec, **parallel)


def mixed_batch(gate_token: int) -> tuple[list[str], list[SamplingParams]]:
    """Constrained and free requests together; `gate_token` ends the gated request's reasoning."""
    requests = [
        ("a record:", constrained(48, json=SCHEMA, disable_any_whitespace=True)),
        ("free text one", FREE),
        ("pattern", constrained(24, regex=REGEX)),
        ("code", constrained(12, logprobs=1, regex=CODE)),
        ("answer:", constrained(8, choice=CHOICES)),
        ("think first", constrained(24, regex=GATED_TAIL, reasoning_end_token_ids=[gate_token])),
        ("free text two", FREE),
    ]
    return [p for p, _ in requests], [s for _, s in requests]


def run_mixed(llm: LLM, gate_token: int) -> list[tuple]:
    prompts, params = mixed_batch(gate_token)
    outputs = llm.generate(prompts, params)
    result = []
    for out in outputs:
        completion = out.outputs[0]
        logprobs = None if completion.logprobs is None else [
            entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs, strict=True)]
        result.append((completion.token_ids, completion.text, completion.finish_reason, logprobs))
    return result


@pytest.fixture(scope="module")
def gate_token(llama_dir) -> int:
    """The first token the model writes freely after "think first": the gated grammar wakes after it."""
    llm = make_llm(llama_dir)
    try:
        return llm.generate(["think first"], FREE)[0].outputs[0].token_ids[0]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def mixed_reference(llama_dir, gate_token) -> list[tuple]:
    llm = make_llm(llama_dir)
    try:
        return run_mixed(llm, gate_token)
    finally:
        llm.shutdown()


def check_valid(result: list[tuple], gate_token: int, llama_dir: str) -> None:
    """Each constrained output satisfies its constraint (and ended because it did)."""
    (_, record, *_), _, (_, pattern, *_), (_, code, *_), (_, answer, *_), (gated_ids, *_), _ = result
    jsonschema.validate(json.loads(record), SCHEMA)
    assert re.fullmatch(REGEX, pattern) and re.fullmatch(CODE, code) and answer in CHOICES
    for index in (0, 2, 3, 4):
        assert result[index][2] == "stop", result[index]
    assert gate_token in gated_ids
    from transformers import AutoTokenizer

    tail = AutoTokenizer.from_pretrained(llama_dir).decode(gated_ids[gated_ids.index(gate_token) + 1:],
                                                           skip_special_tokens=True)
    assert re.fullmatch(GATED_TAIL, tail), tail


@pytest.mark.parametrize("parallel", [dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2)],
                         ids=["pp2", "tp2"])
def test_mixed_batch_equals_world_size_1(llama_dir, gate_token, mixed_reference, parallel):
    check_valid(mixed_reference, gate_token, llama_dir)
    llm = make_llm(llama_dir, cpu_threads_per_rank=1, **parallel)
    try:
        got = run_mixed(llm, gate_token)
        assert llm.engine.core.structured_output.stats.num_jump_forward_tokens > 0  # the JSON keys
        if "pipeline_parallel_size" in parallel:
            with pytest.raises(ValueError, match="structured_outputs.regex"):
                llm.generate(["x"], constrained(4, regex="(unclosed"))
            with pytest.raises(ValueError, match="structured_outputs.json"):
                llm.generate(["x"], constrained(4, json={"type": "no such type"}))
            assert llm.generate(["free text one"], FREE)[0].outputs[0].token_ids == mixed_reference[1][0]
        assert llm.engine.core.scheduler.kv_cache_manager.pool.num_used_blocks == 0
    finally:
        llm.shutdown()
    for i, (mine, ref) in enumerate(zip(got, mixed_reference, strict=True)):
        assert mine[:3] == ref[:3], f"request {i}"
        if ref[3] is not None:
            assert mine[3] == pytest.approx(ref[3], abs=1e-4), f"request {i}"
    check_valid(got, gate_token, llama_dir)


# ---- n-gram drafts: the grammar's cut, computed ahead ---------------------------------------------
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False, "disable_by_batch_size": 64}
LOOP_PROMPTS = ["the the cache draft cat draft cache spec token draft spec tide spec tide the cache cache cache the "
                "draft block token spec draft",
                "token token the the token block token cache draft spec tide",
                "The quick brown fox jumps over the lazy dog. The quick brown fox"]
LOOP_PATTERNS = ["[a-z]+", "[a-m ]+"]
"""Each forbids some of the drafts its request's n-gram proposer takes from the prompt."""
LOOP_PARAMS = [constrained(32, regex=LOOP_PATTERNS[0]), constrained(32, regex=LOOP_PATTERNS[1]),
               SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)]


def run_ngram(model_dir: str, spec: dict | None, monkeypatch, **parallel) -> dict:
    """Tokens, acceptance counters, and per constrained request the drafts left after the grammar's
    cut and how many it cut: at world size 1 from the runner's check, else from the engine core's
    computation ahead (both run in this process)."""
    cuts: dict[str, list] = defaultdict(list)

    def record(checked: dict, proposed: dict, constrained_ids) -> None:
        for req_id in constrained_ids:
            before, after = proposed.get(req_id, []), checked.get(req_id, [])
            if before or after:
                cuts[req_id].append((after, len(before) - len(after)))

    check_drafts, ahead = GrammarStep.check_drafts, GrammarStep.ahead

    def recording_check(self, drafts, keep):
        checked = check_drafts(self, drafts, keep)
        record(checked, drafts, self.grammars)
        return checked

    def recording_ahead(self, num_draft_tokens, propose):
        result = ahead(self, num_draft_tokens, propose)
        proposed = {r: propose(self.token_ids[r], num_draft_tokens[r]) for r in self.grammars if r in num_draft_tokens}
        record(result.drafts, proposed, self.grammars)
        return result

    monkeypatch.setattr(GrammarStep, "check_drafts", recording_check)
    monkeypatch.setattr(GrammarStep, "ahead", recording_ahead)
    llm = make_llm(model_dir, spec, cpu_threads_per_rank=1, **parallel)
    try:
        outputs = llm.generate(LOOP_PROMPTS, LOOP_PARAMS)
        stats = llm.engine.core.get_stats().spec_decoding
        used = llm.engine.core.scheduler.kv_cache_manager.pool.num_used_blocks
    finally:
        llm.shutdown()
    by_prompt = {out.request_id: i for i, out in enumerate(outputs)}
    return {"tokens": [o.outputs[0].token_ids for o in outputs], "texts": [o.outputs[0].text for o in outputs],
            "stats": stats, "used_blocks": used,
            "cuts": {by_prompt[r]: c for r, c in cuts.items() if r in by_prompt}}


@pytest.fixture(scope="module")
def ngram_reference(looping_dir) -> tuple[dict, dict]:
    with pytest.MonkeyPatch.context() as mp:
        plain = run_ngram(looping_dir, None, mp)
    with pytest.MonkeyPatch.context() as mp:
        single = run_ngram(looping_dir, NGRAM, mp)
    return plain, single


@pytest.mark.parametrize("parallel", [dict(pipeline_parallel_size=2),
                                      dict(tensor_parallel_size=2, pipeline_parallel_size=2)],
                         ids=["pp2", "tp2-pp2"])
def test_ngram_drafts_cut_as_at_world_size_1(looping_dir, ngram_reference, monkeypatch, parallel):
    plain, single = ngram_reference
    assert single["tokens"] == plain["tokens"]
    assert sum(n for entries in single["cuts"].values() for _, n in entries) > 0, "the grammar cut no draft"
    got = run_ngram(looping_dir, NGRAM, monkeypatch, **parallel)
    assert got["tokens"] == plain["tokens"]
    assert got["cuts"] == single["cuts"]
    assert got["stats"] == single["stats"]
    assert got["stats"]["num_accepted_tokens"] > 0 and got["stats"]["num_rejections"] > 0, got["stats"]
    assert all(re.fullmatch(pattern, text) for pattern, text in zip(LOOP_PATTERNS, got["texts"], strict=False))
    assert got["used_blocks"] == 0
