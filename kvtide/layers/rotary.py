"""Rotary position embedding (neox layout, rotate_half) with the scaling schemes checkpoints use.

inv_freq and the attention factor come from transformers' ROPE_INIT_FUNCTIONS (linear, dynamic,
llama3, yarn), so our tables are exactly the ones a checkpoint was trained with. cos/sin are
precomputed for every position up to max_model_len and gathered by position each step.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

_SUPPORTED = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_parameters(hf_config) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return params


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
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_dim: int, max_model_len: int, dtype: torch.dtype) -> None:
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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]: bit-identical to transformers'
    x * cos + rotate_half(x) * sin, with half the multiplications."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
