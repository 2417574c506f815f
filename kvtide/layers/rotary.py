"""Rotary position embedding (neox layout, rotate_half) with the scaling schemes checkpoints use.

inv_freq and the attention factor come from transformers' ROPE_INIT_FUNCTIONS (linear, dynamic,
llama3, yarn, longrope), so our tables are exactly the ones a checkpoint was trained with. cos/sin
are precomputed for every position up to max_model_len and gathered by position each step.

Variants: `PartialRotaryEmbedding` rotates only the first rotary_dim dimensions of each head
(partial_rotary_factor < 1: Phi-4-mini); LongRoPE (Phi-3, Phi-3.5, Phi-4-mini) is a table choice,
see `longrope_uses_long_factors`.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

_SUPPORTED = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_parameters(hf_config) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return params


def partial_rotary_factor(hf_config) -> float:
    """The fraction of each head's dimensions rotary embeddings rotate (1.0: all of them)."""
    params = rope_parameters(hf_config)
    return float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0))


def longrope_original_length(hf_config) -> int:
    """The context LongRoPE's short factors were trained for (original_max_position_embeddings)."""
    original = getattr(hf_config, "original_max_position_embeddings", None)
    return int(original or rope_parameters(hf_config).get("original_max_position_embeddings")
               or hf_config.max_position_embeddings)


def longrope_uses_long_factors(hf_config, max_model_len: int) -> bool:
    """Which LongRoPE table serves every position: the long factors where sequences may grow past
    original_max_position_embeddings (max_model_len beyond it), else the short ones.

    transformers picks per forward pass by the sequence length, and its Phi-3 `generate` recomputes
    the whole KV cache with the long factors on the step a sequence first grows past the original
    window, so at every step all cached keys share one table. A paged cache shared across requests
    (prefix caching, chunked prefill, preemption by recompute) keeps keys written at any earlier
    step, so here the table is one function of the position for the engine's whole life, fixed at
    the longest length it serves (as for dynamic NTK scaling below). Equal to transformers'
    `generate` whenever max_model_len <= original_max_position_embeddings (it never switches), and
    for a request whose prompt is already longer than the original window (it starts long); a
    request that starts within the window of an engine serving longer ones gets the long factors
    from its first token, where transformers uses the short ones until it crosses."""
    return max_model_len > longrope_original_length(hf_config)


def compute_inv_freq(hf_config, head_dim: int, max_model_len: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type not in _SUPPORTED:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {_SUPPORTED}")
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type == "dynamic":
        # NTK scaling fixed at the longest length we serve (HF rescales on the fly past the
        # original window; below it, both are the plain table).
        original = hf_config.max_position_embeddings
        if max_model_len <= original:
            base = params["rope_theta"]
            return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
        return ROPE_INIT_FUNCTIONS["dynamic"](copy.deepcopy(hf_config), None, max_model_len)
    if rope_type == "longrope":
        # transformers returns the long factors' inv_freq for a seq_len past the original window
        long = longrope_uses_long_factors(hf_config, max_model_len)
        seq_len = longrope_original_length(hf_config) + 1 if long else None
        return ROPE_INIT_FUNCTIONS["longrope"](hf_config, None, seq_len=seq_len)
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int, max_model_len: int, dtype: torch.dtype) -> None:
        """`head_dim`: the dimensions rotated, each tensor's last one here (a partial rotary's
        rotary_dim: see PartialRotaryEmbedding)."""
        super().__init__()
        self.head_dim = head_dim
        inv_freq, scaling = compute_inv_freq(hf_config, head_dim, max_model_len)
        max_positions = max(max_model_len, getattr(hf_config, "max_position_embeddings", 0))
        positions = torch.arange(max_positions, dtype=torch.int64)
        freqs = positions[:, None].float() * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_positions, head_dim)
        self.register_buffer("cos_cache", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * scaling).to(dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> cos, sin (T, 1, D/2): looked up once per step, shared by all layers.
        (The tables repeat after D/2, so half of each is all rotation needs.)"""
        half = self.head_dim // 2
        return (self.cos_cache[positions, :half].unsqueeze(1),
                self.sin_cache[positions, :half].unsqueeze(1))

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (T, H, D), k (T, H_kv, D) -> rotated q, k."""
        cos, sin = cos_sin
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def forward_qk(self, cos_sin: tuple[torch.Tensor, torch.Tensor], qk: torch.Tensor, num_q_heads: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """qk (T, H + H_kv, D), queries then keys side by side as in a fused qkv -> rotated q, k.
        One rotation over both: half the (small, per-call-bound) elementwise ops of forward."""
        cos, sin = cos_sin
        rotated = _rotate(qk, cos, sin)
        return rotated[:, :num_q_heads], rotated[:, num_q_heads:]


class PartialRotaryEmbedding(RotaryEmbedding):
    """Rotary over the first `rotary_dim` dimensions of each head; the other head_dim - rotary_dim
    pass through unrotated (transformers' partial_rotary_factor). Its own forward: the compiled CPU
    and Triton rotaries, which rotate whole heads, are not swapped in (cpu_ops, triton_ops)."""

    def __init__(self, hf_config, rotary_dim: int, head_dim: int, max_model_len: int, dtype: torch.dtype) -> None:
        assert rotary_dim % 2 == 0 and rotary_dim < head_dim, (rotary_dim, head_dim)
        super().__init__(hf_config, rotary_dim, max_model_len, dtype)
        self.full_head_dim = head_dim

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (T, H, head_dim), k (T, H_kv, head_dim) -> rotated q, k."""
        cos, sin = cos_sin
        return _rotate_part(q, cos, sin, self.head_dim), _rotate_part(k, cos, sin, self.head_dim)

    def forward_qk(self, cos_sin: tuple[torch.Tensor, torch.Tensor], qk: torch.Tensor, num_q_heads: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin
        rotated = _rotate_part(qk, cos, sin, self.head_dim)
        return rotated[:, :num_q_heads], rotated[:, num_q_heads:]


def rotary_embedding(hf_config, head_dim: int, max_model_len: int, dtype: torch.dtype) -> RotaryEmbedding:
    """The rotary of heads of `head_dim`: all of each head, or its first partial_rotary_factor part."""
    rotary_dim = int(head_dim * partial_rotary_factor(hf_config))
    if rotary_dim == head_dim:
        return RotaryEmbedding(hf_config, head_dim, max_model_len, dtype)
    return PartialRotaryEmbedding(hf_config, rotary_dim, head_dim, max_model_len, dtype)


def _rotate_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """x (..., head_dim) -> [rotate(x[..., :rotary_dim]), x[..., rotary_dim:]]."""
    return torch.cat((_rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]: bit-identical to transformers'
    x * cos + rotate_half(x) * sin, with half the multiplications."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
