"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before rotary (q_norm / k_norm)."""

from __future__ import annotations

from kvtide.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
