"""The runner's CPU bitmask application against xgrammar's own kernel (the reference)."""

from __future__ import annotations


def test_cpu_bitmask_apply_equals_xgrammar_kernel():
    import torch
    import xgrammar as xgr

    from kvtide.structured_output.step import apply_bitmask_cpu

    generator = torch.Generator().manual_seed(0)
    for rows, vocab, indices in ((8, 1000, list(range(8))), (8, 1003, [0, 3, 7]), (3, 32000, [1])):
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, generator=generator)
        logits = torch.randn(rows, vocab, generator=generator)
        expected = logits.clone()
        xgr.apply_token_bitmask_inplace(expected, bitmask, indices=indices, backend="torch_native")
        apply_bitmask_cpu(logits, bitmask, indices)
        assert torch.equal(logits, expected)
