"""Hugging Face transformers as the oracle: greedy `generate` and prompt forward passes in float32.

Each prompt runs alone (batch 1, no padding), so the reference is free of padding effects; results
are cached per (checkpoint, prompt) for the whole session, since several tests compare against the
same reference.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

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
