"""Quantized expert weights: each expert's w13 and w2 as a `QuantizedWeight`, run through the same
weight-only kernels as any quantized linear (layers/quantization/weight_only.py).

In a MoE model the experts are most of the bytes (bench-mixtral: about 73% of its weights;
DeepSeek-V3: over 95%), so an on-the-fly `--quantization int8/int4/fp8` that left them float would save little.
After loading, `FusedMoE.quantize_experts` turns the stacked float parameters into two of these
modules and drops the floats:

    w13_weight (E, 2I, H) float  ->  w13_quantized: qcodes (E, 2I, H or H/2), qscales (E, 2I, groups), ...
    w2_weight  (E, H, I)  float  ->  w2_quantized:  qcodes (E, H, I or I/2),  ...

A GPTQ or AWQ checkpoint's experts arrive as QuantizedWeights already (layers/quantization/packed_experts.py;
act-order ones with an input permutation each, stacked as `qperm`). The per-expert QuantizedWeights
are views of the stacked buffers (the buffers carry the names
`weight_bytes` counts). fused_experts runs them in place of the float weights, expert by expert, with
weight_only.quantized_linear as every expert's GEMM plan: the quantized-bytes kernel for an expert's
few decode rows, dequantize + GEMM for a long prefill's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvtide.layers.quantization.qweight import QuantizedWeight

ExpertQuantizer = Callable[[torch.Tensor], QuantizedWeight]
"""One expert's (N, K) float weight -> its QuantizedWeight (online.py's quantizers)."""


class QuantizedExperts(nn.Module):
    """E experts' quantized projections of one shape, stacked."""

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        super().__init__()
        first = parts[0]
        if any((p.kind, p.group_size, p.out_features, p.in_features) !=
               (first.kind, first.group_size, first.out_features, first.in_features) for p in parts):
            raise ValueError("the experts of one projection must share kind, group size and shape")
        self.register_buffer("qcodes", torch.stack([p.codes for p in parts]), persistent=False)
        self.register_buffer("qscales", torch.stack([p.scales for p in parts]), persistent=False)
        # An expert without mins (or without an input permutation) among others that have them: zeros
        # (the identity), so that all share one layout.
        with_mins = [p for p in parts if p.mins is not None]
        self.register_buffer("qmins", None if not with_mins else torch.stack(
            [p.mins if p.mins is not None else torch.zeros_like(with_mins[0].mins) for p in parts]), persistent=False)
        identity = torch.arange(first.in_features, device=first.codes.device)
        self.register_buffer("qperm", None if all(p.input_perm is None for p in parts) else torch.stack(
            [p.input_perm if p.input_perm is not None else identity for p in parts]), persistent=False)
        self.experts = [QuantizedWeight(first.kind, self.qcodes[e], self.qscales[e],
                                        None if self.qmins is None else self.qmins[e], first.group_size,
                                        first.out_features, first.in_features,
                                        None if self.qperm is None else self.qperm[e]) for e in range(len(parts))]
        """Expert e's weight, as views of the stacked buffers."""

    def __len__(self) -> int:
        return len(self.experts)

    def extra_repr(self) -> str:
        first = self.experts[0]
        return f"experts={len(self)}, kind={first.kind}, shape=({first.out_features}, {first.in_features}), " \
               f"group_size={first.group_size}"
