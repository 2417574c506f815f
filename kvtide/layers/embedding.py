"""Token embedding and LM head (which may share the embedding's weight), split over the vocabulary
under tensor parallelism: the vocabulary is padded to a multiple of the TP size and each rank holds
one contiguous range of rows. A lookup zeroes the ids outside the range and sums the ranks' rows in
one all-reduce; the LM head's logits are all-gathered (every rank samples the same tokens from the
same logits) and the padding columns cut off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvtide.distributed import get_tp_group
from kvtide.layers.cpu_gemm import GemmPlan, linear
from kvtide.layers.linear import take


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = get_tp_group()
        rows = -(-vocab_size // self.tp.world_size)
        self.vocab_start = self.tp.rank_in_group * rows
        """The first vocabulary row this rank holds; it holds `rows_here` real rows, then padding."""
        self.rows_here = max(0, min(rows, vocab_size - self.vocab_start))
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.weight.reads_slices = True  # type: ignore[attr-defined]
        self.embedding_dtype = self.weight.dtype
        self.quant_method = None
        """Set when the table is quantized (layers/quantization/): once it holds its QuantizedWeight
        (`quantized`), rows are dequantized as looked up."""
        self.quantized = None
        self.tied_lm_head = False
        """Whether an LM head shares this table."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.shape[0] != self.vocab_size or tuple(loaded.shape[1:]) != tuple(param.shape[1:]):
            raise ValueError(f"weight shape mismatch: vocabulary table ({self.vocab_size}, "
                             f"{param.shape[1]}) vs checkpoint {tuple(loaded.shape)}")
        param.data[:self.rows_here].copy_(take(loaded, 0, self.vocab_start, self.rows_here))
        param.data[self.rows_here:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            if self.quantized is not None:
                return self.quant_method.embed(self, input_ids)
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_here)
        local = local.masked_fill(outside, 0)
        if self.quantized is not None:  # the rank's rows of the table, quantized
            rows = self.quant_method.embed(self, local)
        else:
            rows = F.embedding(local, self.weight)
        return self.tp.all_reduce(rows.masked_fill_(outside.unsqueeze(-1), 0))


class LMHead(VocabEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.gemm_plan: GemmPlan | None = None
        """On CPU, the GEMM kernels chosen for `weight` per row count (layers/cpu_gemm.py); None: F.linear."""
        self.tied_to: VocabEmbedding | None = None

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:  # (N, rows of this rank) like the float path
            logits = self.quant_method.apply(self, hidden_states, None)
        else:
            logits = linear(hidden_states, self.weight, None, self.gemm_plan)
        if self.tp.world_size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[..., :self.vocab_size]

    def tie(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight
        self.tied_to = embedding
        embedding.tied_lm_head = True
