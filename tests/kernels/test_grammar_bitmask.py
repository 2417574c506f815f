"""Structured output's bitmask application as the runner does it (GrammarStep.apply) on the test
device: on the CPU kvtide's additive-mask path, on CUDA xgrammar's device kernel; both against
xgrammar's plain-torch kernel on the CPU (the reference)."""

from __future__ import annotations

import pytest
import torch

from kvtide.structured_output.step import GrammarStep


class _FixedGrammar:
    """A grammar whose next-token bitmask is given (GrammarStep only asks for the fill)."""

    def __init__(self, words: torch.Tensor) -> None:
        self.words = words

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        bitmask[row] = self.words
        return True


@pytest.mark.parametrize("vocab, constrained", [(1000, [0, 1, 2, 3]), (1003, [0, 2]), (32000, [1])])
def test_grammar_step_masks_exactly_the_constrained_rows(device, vocab, constrained):
    import xgrammar as xgr

    generator = torch.Generator().manual_seed(vocab)
    num_rows, words = 4, (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (num_rows, words), dtype=torch.int32, generator=generator)
    logits = torch.randn(num_rows, vocab, generator=generator)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, indices=constrained, backend="torch_native")

    step = GrammarStep({f"r{i}": _FixedGrammar(bitmask[i]) for i in constrained}, vocab)
    on_device = logits.to(device)
    step.apply(on_device, [(f"r{i}", 1) for i in range(num_rows)])
    assert torch.equal(on_device.cpu(), expected)
