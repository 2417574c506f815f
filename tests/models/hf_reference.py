"""Hugging Face transformers as the oracle: greedy `generate` and prompt forward passes in float32.

Each prompt runs alone (batch 1, no padding), so the reference is free of padding effects; results
are cached per (checkpoint, prompt) for the whole session, since several tests compare against the
same reference.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import pytest
import torch

from kvtide.models.demo import PAD_ID


@dataclass(frozen=True)
class HFGreedy:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    """tokenizer.decode(token_ids, skip_special_tokens=True)."""
    logprobs: torch.Tensor
    """(len(token_ids), vocab) log_softmax of the raw logits that chose each token."""


@functools.cache
def hf_model_and_tokenizer(model_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # ignore_eos: generate() fills unset (None) options from model.generation_config, so EOS has
    # to go from there, not from the config passed in.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_ID
    return model, tokenizer


def hf_prompt_ids(model_dir: str, prompt: str) -> list[int]:
    _, tokenizer = hf_model_and_tokenizer(model_dir)
    return tokenizer(prompt).input_ids


@functools.cache
def _hf_greedy(model_dir: str, prompt_ids: tuple[int, ...], max_tokens: int) -> HFGreedy:
    model, tokenizer = hf_model_and_tokenizer(model_dir)
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    token_ids = out.sequences[0, len(prompt_ids):].tolist()
    assert len(token_ids) == max_tokens, "HF stopped early"
    logprobs = torch.cat(out.logits).float().log_softmax(dim=-1)  # (max_tokens, vocab)
    return HFGreedy(list(prompt_ids), token_ids, tokenizer.decode(token_ids, skip_special_tokens=True),
                    logprobs)


def hf_greedy(model_dir: str, prompt: str | list[int], max_tokens: int) -> HFGreedy:
    ids = hf_prompt_ids(model_dir, prompt) if isinstance(prompt, str) else prompt
    return _hf_greedy(model_dir, tuple(ids), max_tokens)


@functools.cache
def _hf_prompt_logprobs(model_dir: str, prompt_ids: tuple[int, ...]) -> torch.Tensor:
    model, _ = hf_model_and_tokenizer(model_dir)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids])).logits[0]
    return logits[:-1].float().log_softmax(dim=-1)  # row j predicts prompt token j + 1


def hf_prompt_logprobs(model_dir: str, prompt_ids: list[int]) -> torch.Tensor:
    """(P - 1, vocab): row j is the log-distribution of prompt token j + 1 given tokens 0..j."""
    return _hf_prompt_logprobs(model_dir, tuple(prompt_ids))


# ---- prompts -----------------------------------------------------------------------------------
_WORDS = ("the cache holds blocks of keys and values while a scheduler hands out tokens to every "
          "running request so that decoding never waits for a long prompt river mountain seven "
          "quantum lattice ember harbor violet").split()

LONG_PROMPT = " ".join(
    f"Paragraph {i}: the scheduler gives each request a budget of tokens, and the pool of blocks "
    f"grows as sequences grow." for i in range(3))
"""Over 300 tokens (one byte a token) so prompts cross many blocks and any sliding window."""

CJK_EMOJI_PROMPT = "日本語と中文の文章 😀🎉🚀 naïve café — 한국어 텍스트 ✨"


def random_prompts(n: int, seed: int, min_words: int = 1, max_words: int = 40) -> list[str]:
    """Seeded prompts of assorted lengths made of plain words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words)))
            for _ in range(n)]


def assert_greedy_and_logprobs_match_hf(model_dir: str, prompts: list[str], outputs, max_tokens: int,
                                        logprob_tol: float | None = None) -> None:
    """Each output's tokens equal HF `generate`'s greedy ones (the first difference named), and with
    `logprob_tol` each chosen token's logprob within it of HF's."""
    assert len(outputs) == len(prompts)
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        ref = hf_greedy(model_dir, prompt, max_tokens)
        got = out.outputs[0].token_ids
        assert out.prompt_token_ids == ref.prompt_ids, f"prompt {i}: tokenization differs"
        if got != ref.token_ids:
            first = next(j for j, (a, b) in enumerate(zip(got, ref.token_ids, strict=False)) if a != b)
            pytest.fail(f"prompt {i} ({len(ref.prompt_ids)} tokens): first differing output token at {first}: "
                        f"kvtide {got[first:first + 5]} vs HF {ref.token_ids[first:first + 5]}")
        if logprob_tol is not None:
            logprobs = out.outputs[0].logprobs
            assert logprobs is not None and len(logprobs) == max_tokens
            for step, token in enumerate(ref.token_ids):
                assert logprobs[step][token].logprob == pytest.approx(ref.logprobs[step, token].item(),
                                                                      abs=logprob_tol), f"prompt {i} step {step}"
