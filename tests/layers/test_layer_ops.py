"""The compiled CPU layer ops (layers/csrc/layer_ops.cpp) on every ISA build this CPU runs, against
references written here from the ops' definitions in float64:

    rms_norm(x)          x / sqrt(mean(x^2) + eps) * weight
    add_rms_norm         residual += x (exactly torch's float32 add), then rms_norm(residual)
    silu_and_mul         [g | u] -> g / (1 + e^-g) * u
    rotary_embedding     per head [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin], in place
    linear_panels        x @ W^T (+ b) from W packed as (ceil(N / 16), K, 16) panels

Widths that are and are not multiples of the vector width (the scalar tails), strided rows, empty
batches, two threads, bad input; the layer classes use_cpu_ops swaps in (their torch fallbacks for
inputs the ops do not take, and nothing swapped under KVTIDE_CPU_KERNELS=0); the float KV write."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvtide.attention import cpu_extension
from kvtide.attention.cpu_backend import CpuAttentionBackend
from kvtide.layers import cpu_ops, layer_ops
from kvtide.layers.activation import SiluAndMul
from kvtide.layers.cpu_gemm import numerics_ok
from kvtide.layers.norm import RMSNorm
from kvtide.layers.rotary import RotaryEmbedding

ISAS = cpu_extension.available_isas()


def op(name: str, isa: str):
    fn = layer_ops.layer_op(name, isa)
    if fn is None:
        pytest.fail(f"the {isa} build of layer_ops.cpp failed (see the warning logged)")
    return fn


def _rms64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within float32 rounding of a value of that size (a wrong eps, mean or order of the halves is far out)."""
    scale = expected.abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(actual.double(), expected, rtol=2e-6, atol=8e-7 * max(scale, 1.0))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows,width", [(1, 576), (5, 17), (3, 16), (2, 1), (0, 64), (4, 2051), (130, 96)])
def test_rms_norm_and_the_residual_add(isa, rows, width):
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    big = torch.randn(rows, width + 5, generator=gen) * 3
    x = big[:, 2:2 + width]  # rows with a stride of their own
    weight = torch.randn(width, generator=gen)
    residual = torch.randn(rows, width, generator=gen)
    out = torch.empty(rows, width)
    op("rms_norm", isa)(out, x, weight, 1e-5)
    _close(out, _rms64(x, weight, 1e-5))

    summed = residual + x
    out2 = torch.empty(rows, width)
    op("add_rms_norm", isa)(out2, x, residual, weight, 1e-6)
    assert torch.equal(residual, summed)  # written in place, the same float32 sum as torch's
    _close(out2, _rms64(summed, weight, 1e-6))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows,d", [(1, 1536), (3, 7), (2, 16), (0, 32), (9, 45)])
def test_silu_and_mul(isa, rows, d):
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(rows, 2 * d, generator=gen) * 4
    out = torch.empty(rows, d)
    op("silu_and_mul", isa)(out, x)
    g, u = x[:, :d].double(), x[:, d:].double()
    _close(out, g / (1 + torch.exp(-g)) * u)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", [(1, 9, 3, 64), (5, 4, 1, 80), (3, 2, 2, 6), (0, 2, 1, 64)])
def test_rotary_embedding_in_place_on_a_fused_qkv(isa, tokens, q_heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(tokens, q_heads + 2 * kv_heads, head_dim, generator=gen)
    before = qkv.clone()
    half = head_dim // 2
    angles = torch.rand(tokens, half, generator=gen, dtype=torch.float64) * 6
    cos, sin = angles.cos().float(), angles.sin().float()
    qk = qkv[:, :q_heads + kv_heads]
    if tokens % 2:  # RotaryEmbedding.cos_sin's (T, 1, D/2) form
        op("rotary_embedding", isa)(qk, cos[:, None], sin[:, None])
    else:
        op("rotary_embedding", isa)(qk, cos, sin)
    x1, x2 = before[:, :q_heads + kv_heads, :half].double(), before[:, :q_heads + kv_heads, half:].double()
    c, s = cos.double()[:, None], sin.double()[:, None]
    _close(qkv[:, :q_heads + kv_heads], torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
    assert torch.equal(qkv[:, q_heads + kv_heads:], before[:, q_heads + kv_heads:])  # v untouched


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n,k", [(960, 576), (17, 3), (16, 1), (1, 64), (49, 1537), (40, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_panels(isa, n, k, bias):
    gen = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    panels = layer_ops.pack_panels(weight)
    assert panels.shape == (math.ceil(n / 16), k, 16)
    for rows in (0, 1, 2, 3, 4, 5, 8, 13, 26, 40):  # 12-row tiles (AVX-512) and their remainders
        x = torch.randn(rows, k, generator=gen)
        out = torch.full((rows, n), float("nan"))
        op("linear_panels", isa)(out, x, panels, b)
        if rows == 0:
            continue
        reference = x.double() @ weight.double().T + (0 if b is None else b.double())
        abs_sums = x.double().abs() @ weight.double().abs().T + (0 if b is None else b.double().abs())
        assert numerics_ok(out, reference, F.linear(x, weight, b), abs_sums, k), (rows, n, k)


def test_linear_panels_splits_over_two_threads_with_the_same_result():
    old = torch.get_num_threads()
    weight, x = torch.randn(4000, 300), torch.randn(3, 300)
    panels = layer_ops.pack_panels(weight)
    try:
        torch.set_num_threads(1)
        one = layer_ops.linear_panels(x, 4000, panels, None)
        torch.set_num_threads(2)
        two = layer_ops.linear_panels(x, 4000, panels, None)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)  # each output column is summed by one thread, in one order


def test_the_prefetch_distance_changes_speed_only():
    weight, x = torch.randn(700, 300), torch.randn(5, 300)
    panels = layer_ops.pack_panels(weight)
    outputs = []
    try:
        for distance in (0, 1, 32, 1024):
            layer_ops.set_panel_prefetch(distance)
            outputs += [layer_ops.linear_panels(x[:rows], 700, panels, None) for rows in (1, 5)]
    finally:
        layer_ops.set_panel_prefetch(32)
    assert all(torch.equal(out, ref) for out, ref in zip(outputs[2:], outputs[:2] * 3, strict=True))
    for bad in (-1, 1025):
        with pytest.raises(RuntimeError, match="rows must be in"):
            layer_ops.set_panel_prefetch(bad)


def test_bad_input_is_refused_with_a_message():
    isa = ISAS[0]
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="x must be float32"):
        op("rms_norm", isa)(torch.empty(2, 8), x.double(), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be float32"):
        op("rms_norm", isa)(torch.empty(2, 8), x, torch.ones(9), 1e-6)
    with pytest.raises(RuntimeError, match="residual must be shaped like x"):
        op("add_rms_norm", isa)(torch.empty(2, 8), x, torch.zeros(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match=r"x must be \(T, 2d\)"):
        op("silu_and_mul", isa)(torch.empty(2, 3), x)
    with pytest.raises(RuntimeError, match="cos and sin must be float32"):
        op("rotary_embedding", isa)(torch.randn(2, 1, 8), torch.ones(2, 3), torch.ones(2, 4))
    with pytest.raises(RuntimeError, match="cos and sin must be float32"):
        op("rotary_embedding", isa)(torch.randn(2, 1, 8), torch.ones(2, 2, 4), torch.ones(2, 2, 4))
    with pytest.raises(RuntimeError, match="panels must be float32"):
        op("linear_panels", isa)(torch.empty(2, 16), x, torch.zeros(1, 9, 16), None)
    with pytest.raises(RuntimeError, match="out must be"):
        op("linear_panels", isa)(torch.empty(2, 17), x, torch.zeros(1, 8, 16), None)
    with pytest.raises(RuntimeError, match=r"bias must be float32 \(N,\)"):
        op("linear_panels", isa)(torch.empty(2, 16), x, torch.zeros(1, 8, 16), torch.zeros(15))


# ---- the layer classes ---------------------------------------------------------------------------------
class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(32, 1e-5)
        self.act = SiluAndMul()
        config = type("Config", (), {"rope_theta": 10000.0, "max_position_embeddings": 64})()
        self.rotary = RotaryEmbedding(config, 16, 64, torch.float32)


def test_use_cpu_ops_swaps_the_layers_and_keeps_their_results():
    block = _Block()
    torch.nn.init.normal_(block.norm.weight)
    x, residual = torch.randn(3, 32), torch.randn(3, 32)
    positions = torch.tensor([0, 5, 63])
    cos_sin = block.rotary.cos_sin(positions)
    qkv = torch.randn(3, 6, 16)
    expected = (block.norm(x), block.norm(x, residual.clone())[0], block.act(x),
                block.rotary.forward_qk(cos_sin, qkv[:, :4], 3))
    assert cpu_ops.use_cpu_ops(block) == 3
    assert type(block.norm) is cpu_ops.CpuRMSNorm and type(block.act) is cpu_ops.CpuSiluAndMul
    res = residual.clone()
    actual = (block.norm(x), block.norm(x, res)[0], block.act(x), block.rotary.forward_qk(cos_sin, qkv[:, :4], 3))
    assert torch.equal(res, residual + x)
    for a, e in zip(actual[:3], expected[:3], strict=True):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)
    for a, e in zip(actual[3], expected[3], strict=True):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)
    # Inputs the ops do not take go to the torch versions: bfloat16, 3-D (per-head q/k norms).
    xb = x.bfloat16()
    assert torch.equal(block.norm(xb), RMSNorm.forward(block.norm, xb))
    heads = torch.randn(2, 4, 32)
    assert torch.equal(block.norm(heads), RMSNorm.forward(block.norm, heads))
    q16 = torch.randn(3, 2, 16, dtype=torch.float64)  # another dtype: rotated by the torch version
    torch.testing.assert_close(block.rotary(cos_sin, q16, q16)[0],
                               RotaryEmbedding.forward(block.rotary, cos_sin, q16, q16)[0])


def test_nothing_is_swapped_without_the_compiled_ops(monkeypatch):
    monkeypatch.setattr(layer_ops, "_resolved", {})
    monkeypatch.setenv("KVTIDE_CPU_KERNELS", "0")
    block = _Block()
    assert cpu_ops.use_cpu_ops(block) == 0
    assert type(block.norm) is RMSNorm and type(block.act) is SiluAndMul and type(block.rotary) is RotaryEmbedding


# ---- the float KV write ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_kv_write_equals_index_copy(dtype):
    backend = CpuAttentionBackend()
    assert backend._write_float_op is not None
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, heads, dim = 6, 16, 3, 64
    cache = torch.randn(2, heads, num_blocks, block_size, dim, generator=gen).to(dtype)
    expected = cache.clone()
    qkv = torch.randn(5, 2 + 2 * heads, dim, generator=gen).to(dtype)
    key, value = qkv[:, 2:2 + heads], qkv[:, 2 + heads:]  # strided views of a fused projection
    slots = torch.tensor([3, 17, 95, -1, 40])
    backend.write_kv(key, value, cache, slots)
    live = slots >= 0
    for i, x in enumerate((key, value)):
        expected[i].view(heads, -1, dim).index_copy_(1, slots[live], x[live].transpose(0, 1))
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="outside the cache"):
        backend.write_kv(key, value, cache, torch.tensor([0, 1, 2, 3, num_blocks * block_size]))
