"""Hugging Face transformers in float32 as the oracle for pooling models: each prompt runs alone
(batch 1, no padding), its final hidden states pooled the way the engine is asked to pool them."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

PROMPTS = ["hello world", "x", "a much longer prompt about the weather in the mountains today, and tomorrow",
           "pooling models turn text into vectors", "short one", "the quick brown fox jumps over the lazy dog " * 3]
"""Mixed lengths (1 to ~130 tokens with the byte tokenizer, BOS included)."""


@functools.cache
def hf_model(model_dir: str, kind: str = "base"):
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    cls = AutoModelForSequenceClassification if kind == "classify" else AutoModel
    return cls.from_pretrained(model_dir, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(model_dir)


def hf_ids(model_dir: str, text: str, second: str | None = None) -> list[int]:
    _, tokenizer = hf_model(model_dir)
    return tokenizer(text, second).input_ids if second is not None else tokenizer(text).input_ids


def hf_embedding(model_dir: str, text: str, pooling: str, normalize: bool = True) -> torch.Tensor:
    model, _ = hf_model(model_dir)
    with torch.inference_mode():
        hidden = model(torch.tensor([hf_ids(model_dir, text)])).last_hidden_state[0]
    pooled = {"LAST": hidden[-1], "CLS": hidden[0], "MEAN": hidden.mean(dim=0)}[pooling]
    return F.normalize(pooled, dim=-1) if normalize else pooled


def hf_logits(model_dir: str, text: str, second: str | None = None) -> torch.Tensor:
    model, _ = hf_model(model_dir, "classify")
    with torch.inference_mode():
        return model(torch.tensor([hf_ids(model_dir, text, second)])).logits[0].float()


def cosine_distance(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return 1.0 - float(F.cosine_similarity(a, b, dim=0))
