"""Qwen2: the Llama decoder with a bias on the q, k and v projections."""

from __future__ import annotations

from kvtide.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias_from_config = False
