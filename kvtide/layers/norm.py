"""RMSNorm, optionally fused with the residual add that precedes it; and Gemma's variant, which
scales by (1 + weight) in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvtide.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if x.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        # Normalized in float32 and cast back before the weight, as transformers does.
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With: (norm(x + residual), x + residual); the sum is
        written into `residual`, which the caller hands over."""
        if residual is None:
            return self._norm(x)
        residual.add_(x)
        return self._norm(residual), residual


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), all in float32 and cast back once at the end
    (checkpoints store the weight as an offset from 1, and transformers multiplies before the cast,
    unlike Llama's norm). No fused residual form: Gemma adds residuals after its post-norms."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
