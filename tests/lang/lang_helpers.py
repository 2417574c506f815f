"""What the lang tests share: the tiny engine they build and the prefix-cache arithmetic."""

from __future__ import annotations

BLOCK_SIZE = 16


def make_llm(model_dir: str):
    from kvtide import LLM

    return LLM(model_dir, device="cpu", dtype="float32", max_model_len=512, block_size=BLOCK_SIZE,
               kv_cache_memory="24MiB")


def cached_after(num_prompt_tokens: int) -> int:
    """Prompt tokens the prefix cache can serve for a prompt whose whole prefix is cached: full
    blocks only, and never the last prompt token (its logits must be computed)."""
    return (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
