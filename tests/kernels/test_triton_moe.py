"""The Triton grouped-GEMM MoE (layers/moe/triton_moe.py) equals fused_experts, the torch path:
small random shapes under the interpreter on CPU (natively with KVTIDE_TEST_DEVICE=cuda), k = 1 and 2,
T in {1, 7, 33}, an expert without tokens, skipped assignments (id E), tiles that do not divide
the matrices, several row blocks per expert; and the alignment of assignments into expert blocks."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from kvtide.layers.moe import FusedMoE, fused_experts, select_experts

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = os.environ.get("KVTIDE_TEST_DEVICE", "cpu")
MODULE = "kvtide.layers.moe.triton_moe"

kernels = importlib.import_module(MODULE)  # interpreted on CPU: conftest imports it so

HIDDEN, INTERMEDIATE = 48, 40  # neither a multiple of BLOCK_K (32) nor 2I = 80 of BLOCK_N (64)


def _problem(num_tokens: int, num_experts: int, top_k: int, seed: int, dtype=torch.float32, idle: int | None = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    w13 = torch.randn(num_experts, 2 * INTERMEDIATE, HIDDEN, generator=g) * HIDDEN ** -0.5
    w2 = torch.randn(num_experts, HIDDEN, INTERMEDIATE, generator=g) * INTERMEDIATE ** -0.5
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if idle is not None:
        logits[:, idle] = float("-inf")
    weights, ids = select_experts(logits, top_k, renormalize=top_k > 1)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids


def _on(device, *tensors):
    return [t.to(device) for t in tensors]


@pytest.mark.triton
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("num_experts,top_k", [(4, 1), (4, 2), (8, 2)])
def test_float32_equals_fused_experts(device, close, num_tokens, num_experts, top_k):
    x, w13, w2, weights, ids = _problem(num_tokens, num_experts, top_k, seed=num_tokens * 10 + num_experts)
    assert 1 not in ids.tolist()
    expected = fused_experts(x, w13, w2, weights, ids)
    actual = kernels.triton_fused_experts(*_on(device, x, w13, w2, weights, ids))
    assert actual.dtype == torch.float32 and actual.shape == (num_tokens, HIDDEN)
    close(actual, expected, torch.float32)


@pytest.mark.triton
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(device, close, dtype):
    x, w13, w2, weights, ids = _problem(7, 8, 2, seed=3, dtype=dtype)
    expected = fused_experts(x.float(), w13.float(), w2.float(), weights, ids)
    actual = kernels.triton_fused_experts(*_on(device, x, w13, w2, weights, ids))
    assert actual.dtype == dtype
    close(actual, expected, dtype)


@pytest.mark.triton
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_several_blocks_per_expert_and_skipped_assignments(device, close):
    """33 tokens on 4 experts in BLOCK_M 16: runs of 3+ blocks, partial last blocks; some ids are E
    (as capacity drops leave them) and a token with no expert at all gets 0."""
    x, w13, w2, weights, ids = _problem(33, 4, 2, seed=4, idle=None)
    ids[5] = 4
    ids[9, 1] = 4
    weights[9, 1] = 0.0
    expected = fused_experts(x, w13, w2, weights, ids)
    actual = kernels.triton_fused_experts(*_on(device, x, w13, w2, weights, ids),
                                          tiling={"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16})
    close(actual, expected, torch.float32)
    assert torch.equal(actual[5].cpu(), torch.zeros(HIDDEN))


def test_align_assignments_as_the_docstring():
    sorted_ids, block_expert = kernels.align_assignments(torch.tensor([[2, 0], [0, 3]]), 4, 2)
    assert sorted_ids.tolist()[:6] == [1, 2, 0, 4, 3, 4]
    assert sorted_ids.tolist()[6:] == [4] * 6  # (ceil(4 / 2) + 4) * 2 slots, the rest padding
    assert block_expert.tolist() == [0, 2, 3, 4, 4, 4]


def test_align_assignments_groups_every_assignment_once():
    ids = torch.randint(0, 7, (50, 2), generator=torch.Generator().manual_seed(5))  # 6 experts, id 6 skipped
    ids[ids[:, 0] == ids[:, 1], 1] = 6
    sorted_ids, block_expert = kernels.align_assignments(ids, 6, 16)
    flat = ids.flatten()
    rows = sorted_ids.view(-1, 16)
    for block, expert in enumerate(block_expert.tolist()):
        real = [a for a in rows[block].tolist() if a < flat.numel()]
        assert all(int(flat[a]) == expert for a in real)
        assert real == sorted(real)  # token order within an expert
    placed = sorted(a for a in sorted_ids.tolist() if a < flat.numel())
    assert placed == [a for a in range(flat.numel()) if flat[a] < 6]
    assert block_expert.tolist() == sorted(block_expert.tolist())


@pytest.mark.skipif(DEVICE != "cuda", reason="FusedMoE.use_triton applies to CUDA tensors")
def test_fused_moe_layer_through_the_kernel(device, close):
    moe = FusedMoE(8, 2, HIDDEN, INTERMEDIATE, renormalize=True).to(device)
    x, w13, w2, _, _ = _problem(7, 8, 2, seed=6)
    moe.w13_weight.data.copy_(w13)
    moe.w2_weight.data.copy_(w2)
    logits = torch.randn(7, 8, device=device)
    expected = moe(x.to(device), logits)
    moe.use_triton = True
    close(moe(x.to(device), logits), expected, torch.float32)


def test_module_imports_without_triton():
    """Without triton the module imports (FusedMoE keeps its torch path) and the kernel says why not."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        f"import {MODULE} as m\n"
        "try:\n"
        "    m.triton_fused_experts(torch.randn(1, 8), torch.randn(2, 8, 8), torch.randn(2, 8, 4),\n"
        "                           torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long))\n"
        "except RuntimeError as e:\n"
        "    assert 'Triton' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('triton_fused_experts ran without triton')\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
