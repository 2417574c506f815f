"""Speculative decoding on tensor- and pipeline-parallel replicas (spec_decode/parallel.py): n-gram
drafts under TP=2, PP=2 and TP=2 x PP=2, a draft model (sharded over the TP group), layer skip and
Medusa heads under TP=2, on real multi-process replicas (gloo on 127.0.0.1, one thread per rank).

Against world size 1: greedy tokens equal non-speculative decoding's and chosen-token logprobs are
within 1e-4; a seeded sampled request draws the same tokens as world size 1 with the same
speculative config; the acceptance counters equal world size 1's (every rank proposed and accepted
what one rank does) and show accepted and rejected drafts (so the rollback ran); no KV block leaks.
A constrained request's drafts, cut by the grammar in the engine core, reach every rank (under PP the
cut and the masks are computed ahead and shipped with the step).

A random checkpoint almost never repeats itself, so the n-gram cases run one whose first three
layers' attention output is zeroed (seed 3): the last layer still attends over the paged cache,
and greedy decoding falls into short loops that the n-gram proposer predicts.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from kvtide import LLM, SamplingParams
from kvtide.engine_args import EngineArgs
from kvtide.sampling_params import StructuredOutputsParams

MAX_TOKENS = 16
MAX_MODEL_LEN = 256
LOGPROB_TOL = 1e-4
PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "the the cache draft cat draft cache spec token draft spec tide spec tide the cache cache cache the "
           "draft block token spec draft",
           "cat tide cache tide cache cache block cache cat block spec tide draft block token cat tide",
           "token token the the token block token cache draft spec tide", "abc abc abc abc abc abc"]
"""Prompts whose greedy continuations (of the n-gram checkpoint) the n-gram proposer partly predicts."""
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
CONSTRAINED = SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                             structured_outputs=StructuredOutputsParams(regex="(ab|ac|b)+c"))

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
CASES = {
    "ngram-tp2": ("looping", NGRAM, dict(tensor_parallel_size=2)),
    "ngram-pp2": ("looping", NGRAM, dict(pipeline_parallel_size=2)),
    "ngram-tp2-pp2": ("looping", NGRAM, dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
    "draft-model-tp2": ("llama", {"method": "draft_model", "num_speculative_tokens": 3, "model": "{other}",
                                  "adaptive": False}, dict(tensor_parallel_size=2)),
    "layer-skip-tp2": ("llama", {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 2,
                                 "adaptive": False}, dict(tensor_parallel_size=2)),
    "medusa-tp2": ("llama", {"method": "medusa", "num_speculative_tokens": 3, "model": "{medusa}",
                             "adaptive": False}, dict(tensor_parallel_size=2)),
}


def make_llm(model_dir: str, spec: dict | None = None, **kwargs) -> LLM:
    if spec is not None:
        spec = {"disable_by_batch_size": 64, **spec}
    return LLM(model_dir, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory="4MiB",
               enable_prefix_caching=False, speculative_config=spec, **kwargs)


@pytest.fixture(scope="module")
def medusa_dir(tmp_path_factory, llama_dir) -> str:
    """Three random Medusa heads (vLLM's layout, one block each) for the tiny Llama: they propose
    poorly, so only the drafts' count is asserted."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(llama_dir)
    hidden, vocab = config.hidden_size, config.vocab_size
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for i in range(3):
        tensors[f"blocks.{i}.layers.0.weight"] = torch.randn(hidden, hidden, generator=g) * 0.1
        tensors[f"lm_heads.{i}.weight"] = torch.randn(vocab, hidden, generator=g) * 0.1
    path = str(tmp_path_factory.mktemp("medusa"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"num_heads": 3, "num_hidden_layers": 1, "hidden_size": hidden, "vocab_size": vocab}, f)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def world_size_1(checkpoint_factory, looping_dir, llama_dir, medusa_dir):
    """Outputs at world size 1, one engine at a time: key -> what it produced. The draft model is
    another (2-layer) tiny Llama: drafts partly accepted, so rejected slots are rolled back."""
    dirs = {"looping": looping_dir, "llama": llama_dir, "medusa": medusa_dir,
            "other": checkpoint_factory("LlamaForCausalLM", seed=0, num_hidden_layers=2)}
    cache: dict[tuple, dict] = {}

    def get(model: str, spec: dict | None) -> dict:
        key = (model, repr(spec))
        if key not in cache:
            llm = make_llm(dirs[model], spec)
            try:
                cache[key] = run_workload(llm, constrained=model == "looping")
            finally:
                llm.shutdown()
        return cache[key]

    return dirs, get


def run_workload(llm: LLM, constrained: bool) -> dict:
    greedy = llm.generate(PROMPTS, GREEDY)
    result = {"greedy": [summary(o) for o in greedy],
              "seeded": [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], SEEDED)]}
    if constrained:
        result["constrained"] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[1:3], CONSTRAINED)]
    result["stats"] = llm.engine.core.get_stats().spec_decoding
    result["used_blocks"] = llm.engine.core.scheduler.kv_cache_manager.pool.num_used_blocks
    return result


def summary(out) -> tuple[list[int], list[float]]:
    completion = out.outputs[0]
    return completion.token_ids, [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs,
                                                                        strict=True)]


@pytest.mark.parametrize("case", list(CASES))
def test_parallel_speculation_equals_world_size_1(world_size_1, case):
    model, spec, parallel = CASES[case]
    dirs, reference = world_size_1
    spec = {k: v.format(**dirs) if isinstance(v, str) else v for k, v in spec.items()}
    plain, single = reference(model, None), reference(model, spec)
    llm = make_llm(dirs[model], spec, cpu_threads_per_rank=1, **parallel)
    try:
        got = run_workload(llm, constrained=model == "looping")
    finally:
        llm.shutdown()
    for i, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(
            zip(got["greedy"], plain["greedy"], strict=True)):
        assert tokens == ref_tokens, f"{case}: prompt {i}"
        assert logprobs == pytest.approx(ref_logprobs, abs=LOGPROB_TOL), f"{case}: prompt {i}"
    assert got["seeded"] == single["seeded"]
    if "constrained" in got:  # drafts the grammar cut beside rank 0 are cut on every rank too
        assert got["constrained"] == plain["constrained"] == single["constrained"]
    stats = got["stats"]
    assert stats == single["stats"], f"{case}: the ranks proposed or accepted otherwise than one rank"
    if spec["method"] == "medusa":  # random heads: drafts, rarely accepted
        assert stats["num_drafts"] > 0, stats
    else:
        assert stats["num_accepted_tokens"] > 0 and stats["num_rejections"] > 0, stats
    assert got["used_blocks"] == 0


def config_error(model_dir: str, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        EngineArgs(model=model_dir, cpu_threads_per_rank=1, **kwargs).create_engine_config(model_dir)
    return str(info.value)


def test_refused_combinations(checkpoint_factory, llama_dir):
    """Drafts that come from a model (or the target's hidden states) under pipeline parallelism, and
    a draft whose heads the TP group cannot split."""
    draft = {"method": "draft_model", "num_speculative_tokens": 2, "model": llama_dir}
    message = config_error(llama_dir, pipeline_parallel_size=2, speculative_config=draft)
    assert "'draft_model' does not combine with pipeline parallelism" in message and "'ngram'" in message
    one_head = checkpoint_factory("LlamaForCausalLM", num_attention_heads=1, num_key_value_heads=1,
                                  num_hidden_layers=1)
    message = config_error(llama_dir, tensor_parallel_size=2,
                           speculative_config={**draft, "model": one_head})
    assert "the draft model's attention heads (1)" in message
    EngineArgs(model=llama_dir, cpu_threads_per_rank=1, tensor_parallel_size=2, pipeline_parallel_size=2,
               speculative_config=NGRAM).create_engine_config(llama_dir)  # accepted
