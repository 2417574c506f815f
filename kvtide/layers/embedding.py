"""Token embedding and LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvtide.layers.cpu_gemm import GemmPlan, linear
from kvtide.layers.linear import default_weight_loader


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.embedding_dtype = self.weight.dtype
        self.quant_method = None
        """Set when the table is quantized (layers/quantization/): once it holds its QuantizedWeight
        (`quantized`), rows are dequantized as looked up."""
        self.quantized = None
        self.tied_lm_head = False
        """Whether an LM head shares this table."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quant_method.embed(self, input_ids)
        return F.embedding(input_ids, self.weight)


class LMHead(VocabEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.gemm_plan: GemmPlan | None = None
        """On CPU, the GEMM kernels chosen for `weight` per row count (layers/cpu_gemm.py); None: F.linear."""
        self.tied_to: VocabEmbedding | None = None

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quant_method.apply(self, hidden_states, None)
        return linear(hidden_states, self.weight, None, self.gemm_plan)

    def tie(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight
        self.tied_to = embedding
        embedding.tied_lm_head = True
