"""The quantized-weight GEMMs equal the float64 product with `dequantize(qw)` (qweight.py's
reference): the Triton kernel for int8 / int4 / fp8 codes, per-channel and grouped, with mins, with
an act-order permutation, odd N and K, decode and prefill row counts; and the FP8 tensor-core path's
per-token activation quantization (plus its _scaled_mm plumbing, which this torch also runs on CPU).

Tolerances are relative to sum_k |x[m, k]| |w[n, k]|, not to |out|: an output near zero (products
cancelling) has no relative accuracy in any float32 sum, so that is the scale every rounding error
is proportional to."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import subprocess
import sys
import zlib

import pytest
import torch

from kvtide.layers.quantization.qweight import (
    FP8_MAX,
    QuantizedWeight,
    dequantize,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = os.environ.get("KVTIDE_TEST_DEVICE", "cpu")
MODULE = "kvtide.layers.quantization.triton_kernels"


kernels = importlib.import_module(MODULE)  # interpreted on CPU: conftest imports it so

N_ODD = 100  # not a multiple of any column tile


# ---- weights ----------------------------------------------------------------------------------
def _int8_with_mins(n: int, k: int, seed: int) -> QuantizedWeight:
    """Hand-made int8 with mins and groups of 16 (the Q6_K shape): every group its own scale/min."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // 16, generator=g) * 0.02 + 0.001
    mins = torch.randn(n, k // 16, generator=g) * 0.5
    return QuantizedWeight("int8", codes, scales, mins, 16, n, k)


def _with_perm(qw: QuantizedWeight, seed: int) -> QuantizedWeight:
    perm = torch.randperm(qw.in_features, generator=torch.Generator().manual_seed(seed))
    return QuantizedWeight(qw.kind, qw.codes, qw.scales, qw.mins, qw.group_size, qw.out_features,
                           qw.in_features, perm)


def _weight(name: str) -> QuantizedWeight:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # stable across processes
    make = {  # name: (N, K, quantize)
        "int8-channel": (N_ODD, 160, lambda w: quantize_int8(w)),
        "int8-g32": (48, 256, lambda w: quantize_int8(w, 32)),
        "int8-g128": (48, 256, lambda w: quantize_int8(w, 128)),
        "int4-g32": (N_ODD, 256, lambda w: quantize_int4(w, 32)),
        "int4-g128": (48, 256, lambda w: quantize_int4(w, 128)),
        "int4-g96": (48, 192, lambda w: quantize_int4(w, 96)),  # 32-wide K tiles
        "int4-channel": (48, 64, lambda w: quantize_int4(w, 64)),
        "fp8-k160": (N_ODD, 160, quantize_fp8),
        "fp8-k64": (48, 64, quantize_fp8),
    }
    if name == "int8-mins-g16":
        return _int8_with_mins(48, 64, seed=5)
    if name == "int8-mins-g16-perm":
        return _with_perm(_int8_with_mins(N_ODD, 160, seed=6), seed=7)
    if name == "int4-g64-perm":
        return _with_perm(quantize_int4(torch.randn(48, 256, generator=g), 64), seed=8)
    n, k, quantize = make[name]
    # Rows of different magnitudes, so that a scale read from the wrong row or group shows.
    w = torch.randn(n, k, generator=g) * torch.logspace(-1, 1, n).unsqueeze(1)
    return quantize(w)


WEIGHTS = ["int8-channel", "int8-g32", "int8-g128", "int8-mins-g16", "int8-mins-g16-perm", "int4-g32",
           "int4-g128", "int4-g96", "int4-channel", "int4-g64-perm", "fp8-k160", "fp8-k64"]


def _to(qw: QuantizedWeight, device) -> QuantizedWeight:
    """qw with its tensors on `device`."""
    tensors = ("codes", "scales", "mins", "input_perm")
    return dataclasses.replace(qw, **{name: getattr(qw, name).to(device) for name in tensors
                                      if getattr(qw, name) is not None})


def _reference(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None):
    """(float64 product, its error scale sum_k |x| |w| (+ |bias|)), x's columns permuted first."""
    x64 = x.double()
    if qw.input_perm is not None:
        x64 = x64[:, qw.input_perm]
    w64 = dequantize(qw).double()
    expected, magnitude = x64 @ w64.T, x64.abs() @ w64.abs().T
    if bias is not None:
        expected, magnitude = expected + bias.double(), magnitude + bias.double().abs()
    return expected, magnitude


def _assert_within(actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor, tol: float):
    assert actual.shape == expected.shape
    err = (actual.double().cpu() - expected.cpu()) / magnitude.cpu().clamp_min(1e-30)
    worst = err.abs().max().item()
    assert worst <= tol, f"error {worst:.3g} x sum|x||w| exceeds {tol:.3g}"


# float32: the kernel's float32 dot over a tile, its scale/min multiply-adds and the reference's own
# float32 rounding of w = s * q + min each err by a few ulps (2^-24 ~ 6e-8) per term, far under 1e-4;
# a wrong code, nibble, scale or group moves the result by O(1) of that scale.
F32_TOL = 1e-4
# 16-bit x: x and the codes are exact in the dot's dtype and it accumulates in float32, so the one
# rounding left is the output's, at most half an ulp: 2^-11 (fp16) or 2^-8 (bf16) relative; 2x margin.
HALF_TOL = {torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}


# ---- quantized_matmul -------------------------------------------------------------------------
@pytest.mark.triton
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("rows,with_bias", [(1, False), (1, True), (5, True), (33, False)])
@pytest.mark.parametrize("name", WEIGHTS)
def test_float32_matmul_equals_the_float64_product(device, name, rows, with_bias):
    qw = _weight(name)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, qw.in_features, generator=g)
    bias = torch.randn(qw.out_features, generator=g) if with_bias else None
    expected, magnitude = _reference(x, qw, bias)
    actual = kernels.quantized_matmul(x.to(device), _to(qw, device), None if bias is None else bias.to(device))
    assert actual.dtype == torch.float32
    _assert_within(actual, expected, magnitude, F32_TOL)



@pytest.mark.triton
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["int8-mins-g16", "int4-g32", "fp8-k160"])
def test_half_precision_activations(device, name, dtype):
    qw = _weight(name)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(33, qw.in_features, generator=g).to(dtype)
    bias = torch.randn(qw.out_features, generator=g).to(dtype)
    expected, magnitude = _reference(x, qw, bias)  # from the 16-bit values, exactly
    actual = kernels.quantized_matmul(x.to(device), _to(qw, device), bias.to(device))
    assert actual.dtype == dtype
    _assert_within(actual, expected, magnitude, HALF_TOL[dtype])


@pytest.mark.triton
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name", ["int8-mins-g16-perm", "int4-g32", "fp8-k160"])
def test_small_tiles_and_strided_inputs(device, name):
    """16 x 16 output tiles (several row and column programs, both masked at the edge), x a strided
    column slice, and the weight a row slice (`rows`, views with the parent's strides)."""
    qw = _weight(name).rows(10, 90)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(37, 2 * qw.in_features, generator=g)[:, ::2]
    expected, magnitude = _reference(x, qw, None)
    actual = kernels.quantized_matmul(x.to(device), _to(qw, device), tiling={"BLOCK_M": 16, "BLOCK_N": 16})
    _assert_within(actual, expected, magnitude, F32_TOL)


@pytest.mark.triton
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_every_e4m3_bit_pattern_decodes_exactly(device):
    """The kernel decodes fp8 from its bits arithmetically: x = identity reads each decoded code
    back (one product per output, scale 1), so all 254 finite patterns, subnormals and -0 included,
    must equal torch's float8_e4m3fn values bit for bit; a NaN code makes its output column NaN."""
    patterns = torch.arange(256, dtype=torch.int32)
    patterns[(patterns & 0x7F) == 0x7F] = 0  # the two NaN patterns, tested below
    codes = torch.stack([patterns.roll(7 * i) for i in range(16)]).to(torch.uint8)  # (16, 256)
    codes[3, 5] = 0x7F
    qw = QuantizedWeight("fp8", codes, torch.ones(16, 1), None, 256, 16, 256)
    out = kernels.quantized_matmul(torch.eye(256, device=device), _to(qw, device)).cpu()
    values = codes.view(torch.float8_e4m3fn).float().T
    assert out[:, 3].isnan().all()
    finite = [c for c in range(16) if c != 3]
    assert torch.equal(out[:, finite], values[:, finite])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_rejects_what_it_cannot_run():
    qw = quantize_int8(torch.randn(8, 64), group_size=8)  # tl.dot needs K tiles of >= 16
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.quantized_matmul(torch.randn(2, 64), qw)
    with pytest.raises(ValueError, match=r"x must be \(M, 64\)"):
        kernels.quantized_matmul(torch.randn(2, 32), quantize_int8(torch.randn(8, 64)))
    empty = kernels.quantized_matmul(torch.randn(0, 64), quantize_int8(torch.randn(8, 64)))
    assert empty.shape == (0, 8)


def test_module_imports_without_triton():
    """Without triton the module imports and its torch-only functions work; the kernel says why not."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        f"import {MODULE} as m\n"
        "from kvtide.layers.quantization.qweight import quantize_int8\n"
        "assert m.quantize_per_token_fp8(torch.randn(3, 32))[1].shape == (3, 1)\n"
        "try:\n"
        "    m.quantized_matmul(torch.randn(2, 64), quantize_int8(torch.randn(8, 64)))\n"
        "except RuntimeError as e:\n"
        "    assert 'Triton' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('quantized_matmul ran without triton')\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- FP8 activations --------------------------------------------------------------------------
def _activations() -> torch.Tensor:
    """Rows spanning 1e-3..1e3 in magnitude, one all zero, one with elements deep in the fp8
    subnormal range of its scale."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(8, 96, generator=g) * torch.logspace(-3, 3, 8).unsqueeze(1)
    x[2] = 0.0
    x[5, :48] *= 1e-4
    return x


def test_per_token_fp8_round_trip():
    x = _activations()
    x_fp8, scale = kernels.quantize_per_token_fp8(x)
    assert x_fp8.dtype == torch.float8_e4m3fn and x_fp8.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (8, 1)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    # The row max maps to the top of the fp8 range (a scale twice too big would round-trip fine
    # but waste a bit of precision on every element).
    nonzero = [r for r in range(8) if r != 2]
    assert torch.equal(x_fp8.float().abs().amax(1)[nonzero], torch.full((7,), FP8_MAX))
    torch.testing.assert_close(scale[nonzero], x.abs().amax(1, keepdim=True)[nonzero] / FP8_MAX,
                               rtol=1e-6, atol=0)
    assert (x_fp8[2].float() == 0).all()
    # e4m3 keeps 3 mantissa bits: rounding to nearest errs by at most half an ulp, 2^-4 of |x| for
    # values in the normal range (|x| / scale >= 2^-6); below it the grid is the fixed subnormal
    # spacing 2^-9, so the error is at most 2^-10 * scale there. 1e-6 covers the float32 division.
    err = (x_fp8.double() * scale.double() - x.double()).abs()
    bound = 2 ** -4 * x.double().abs() + 2 ** -10 * scale.double() + 1e-6 * x.double().abs()
    assert (err <= bound).all(), (err - bound).max()
    # ... which is within 2^-4 of each row's max.
    assert (err <= 2 ** -4 * x.double().abs().amax(1, keepdim=True)).all()


def test_per_token_fp8_keeps_leading_dimensions():
    x = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    x_fp8, scale = kernels.quantize_per_token_fp8(x)
    assert x_fp8.shape == (2, 3, 32) and scale.shape == (2, 3, 1)
    flat_fp8, flat_scale = kernels.quantize_per_token_fp8(x.reshape(6, 32))
    assert torch.equal(x_fp8.reshape(6, 32).view(torch.uint8), flat_fp8.view(torch.uint8))
    assert torch.equal(scale.reshape(6, 1), flat_scale)


def _cpu_scaled_mm() -> bool:
    """Whether this torch runs torch._scaled_mm on the CPU (recent builds do; CUDA needs sm_89)."""
    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not _cpu_scaled_mm(), reason="this torch has no CPU torch._scaled_mm with row-wise scales")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_fp8_plumbing(dtype):
    """Operand layout and scale orientation, checked against the float64 product of the same FP8
    activations with the dequantized weight: only bf16 output rounding (2^-8) and float32
    accumulation separate them; a transposed scale or operand is off by O(1)."""
    g = torch.Generator().manual_seed(12)
    w = torch.randn(48, 64, generator=g) * torch.logspace(-1, 1, 48).unsqueeze(1)
    qw = quantize_fp8(w)
    x = (torch.randn(5, 64, generator=g) * torch.logspace(-2, 2, 5).unsqueeze(1)).to(dtype)
    bias = torch.randn(48, generator=g).to(dtype)
    out = kernels.scaled_mm_fp8(x, qw.codes, qw.scales, bias)
    assert out.dtype == dtype and out.shape == (5, 48)
    x_fp8, scale = kernels.quantize_per_token_fp8(x)
    xq = x_fp8.double() * scale.double()
    w64 = dequantize(qw).double()
    expected = xq @ w64.T + bias.double()
    magnitude = xq.abs() @ w64.abs().T + bias.double().abs()
    _assert_within(out, expected, magnitude, 2 ** -7)
    # A per-tensor weight scale (one number) broadcasts over the output channels.
    codes = qw.codes.view(torch.float8_e4m3fn).double()
    one = kernels.scaled_mm_fp8(x, qw.codes, torch.tensor(0.5))
    _assert_within(one, 0.5 * (xq @ codes.T), 0.5 * (xq.abs() @ codes.abs().T), 2 ** -7)


def test_fp8_matmul_supported(monkeypatch):
    assert kernels.fp8_matmul_supported("cpu") is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, expected in [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True),
                                 ((10, 0), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert kernels.fp8_matmul_supported("cuda") is expected, capability
        assert kernels.fp8_matmul_supported(torch.device("cuda", 0)) is expected, capability
    assert kernels.fp8_matmul_supported("cpu") is False
