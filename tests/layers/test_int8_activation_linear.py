"""int4 weights times int8 activations (quantized_linear's kind 3, `--quantization w4a8`), on every
ISA build this CPU runs, against a reference written here from the documented arithmetic:

    per activation row and 32-block b: d_b = max|x_b| / 127, a_k = round_half_even(x_k * (127 / max|x_b|))
    (float32 operations, 0 for an all-zero block)
    y[n] = sum_b s[n, g(b)] d_b sum_{k in b} q[n, k] a_k  +  sum_g m[n, g] sum_{k in g} x_k

and against the float product it approximates (the rounding of the activations bounds the gap)."""

from __future__ import annotations

import pytest
import torch

from kvtide.attention import cpu_extension
from kvtide.attention.cpu_extension import available_isas, load_cpu_op
from kvtide.layers.quantization import cpu_kernels
from kvtide.layers.quantization.qweight import QuantizedWeight, pack_int4, quantize_int4

ISAS = available_isas()
KIND_INT4_INT8_ACTIVATIONS = 3
"""The op's `kind` for int4 codes times int8 activations (kInt4A8 in the C++ source)."""
U = 2.0 ** -24


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def linear_op(isa: str):
    op = load_cpu_op(cpu_kernels.SOURCE, "kvtide_quant", "quantized_linear", "int8 activation test", isa)
    if op is None:
        pytest.fail(f"the {isa} build of quantized_linear.cpp failed (see the warning logged)")
    return op


# ---- the reference --------------------------------------------------------------------------------
def activation_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (M, K) float64, d (M, K / 32) float64), block by block from the definition above."""
    m, k = x.shape
    codes = torch.zeros(m, k, dtype=torch.float64)
    d = torch.zeros(m, k // 32, dtype=torch.float64)
    for b in range(k // 32):
        block = x[:, 32 * b:32 * b + 32].float()
        amax = block.abs().max(dim=1).values
        inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
        codes[:, 32 * b:32 * b + 32] = torch.round(block * inv[:, None]).double()  # torch.round: ties to even
        d[:, b] = (amax / 127.0).double()
    return codes, d


def reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
              group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, the magnitude its float32 roundings scale with), float64; codes are (N, K) numbers 0..15."""
    a, d = activation_codes(x)
    m, k = x.shape
    n = codes.shape[0]
    y = torch.zeros(m, n, dtype=torch.float64)
    mag = torch.zeros(m, n, dtype=torch.float64)
    for b in range(k // 32):
        cols = slice(32 * b, 32 * b + 32)
        dots = a[:, cols] @ codes[:, cols].double().T  # integers, exact in float64
        absdots = a[:, cols].abs() @ codes[:, cols].double().T
        s = scales[:, 32 * b // group].double()
        y += dots * d[:, b:b + 1] * s
        mag += absdots * d[:, b:b + 1] * s.abs()
    if mins is not None:
        sums = x.double().reshape(m, k // group, group).sum(-1)
        abssums = x.double().abs().reshape(m, k // group, group).sum(-1)
        y += sums @ mins.double().T
        mag += abssums @ mins.double().abs().T
    return y, mag


def make_case(n: int, k: int, group: int, with_mins: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    rows = torch.logspace(-3, 0, n).unsqueeze(1)  # a scale from the wrong row or group shows
    scales = (rows * (0.5 + torch.rand(n, k // group, generator=g))).float().contiguous()
    mins = (torch.randn(n, k // group, generator=g) * scales * 8).float().contiguous() if with_mins else None
    qw = QuantizedWeight("int4", pack_int4(codes), scales, mins, group, n, k, int8_activations=True)
    return qw, codes


def inputs(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows of different sizes, an outlier column, and an all-zero block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m).unsqueeze(1)
    x[:, min(5, k - 1)] *= 30
    x[0, :32] = 0.0
    return x


def run(op, x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    out = torch.full((x.shape[0], qw.out_features), float("nan"))
    op(out, x, qw.codes, qw.scales, qw.mins, KIND_INT4_INT8_ACTIVATIONS, qw.group_size)
    return out


# K: one block, chunks with a tail of 1-3 blocks (a chunk is 4 blocks with AVX-512, 2 with AVX2),
# whole chunks; groups: 32, 64, 96 (straddling chunks), 128 and per channel.
CASES = [(32, 32), (96, 32), (160, 32), (576, 32), (576, 64), (576, 96), (1536, 128), (256, 256), (224, 224)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k,group", CASES, ids=[f"k{k}-g{g}" for k, g in CASES])
@pytest.mark.parametrize("with_mins", [True, False], ids=["mins", "no-mins"])
def test_kernel_equals_the_integer_arithmetic(isa, k, group, with_mins):
    op = linear_op(isa)
    for m in (1, 2, 3, 4, 5, 9):
        for n in (1, 17, 40):
            qw, codes = make_case(n, k, group, with_mins, seed=m * 100 + n)
            x = inputs(m, k, seed=m + n)
            expected, mag = reference(x, codes, qw.scales, qw.mins, group)
            out = run(op, x, qw)
            # Integer dots are exact; each of the <= K/32 block terms and the <= K/group mins terms
            # is rounded a few times in float32, then summed: within (K + 16) u of their magnitudes.
            err = ((out.double() - expected).abs() / mag.clamp_min(1e-300)).max().item()
            assert err <= (k + 16) * U, f"{isa} M={m} N={n} K={k} g={group}: error {err:.3g}"


@pytest.mark.parametrize("isa", ISAS)
def test_the_gap_to_float_activations_is_the_activations_rounding(isa):
    """The result is not the float product (the activations really are rounded) and is within the
    rounding's bound of it: |x - d a| <= d / 2 per element, so |y_a8 - y| <= sum_b d_b / 2 sum_k |w|."""
    op = linear_op(isa)
    k, group = 576, 32
    qw, codes = make_case(64, k, group, True, seed=3)
    x = inputs(5, k, seed=4)
    w = (codes.double().reshape(64, k // group, group) * qw.scales.double()[..., None]
         + qw.mins.double()[..., None]).reshape(64, k)
    exact = x.double() @ w.T
    out = run(op, x, qw).double()
    _, d = activation_codes(x)
    s_blocks = qw.scales.double().repeat_interleave(group // 32, dim=1)  # (N, blocks)
    code_mass = codes.double().reshape(64, k // 32, 32).sum(-1) * s_blocks  # sum_k |s q| per block
    bound = (d / 2) @ code_mass.T + 1e-4 * (x.double().abs() @ w.abs().T)
    gap = (out - exact).abs()
    assert (gap <= bound).all(), (gap / bound).max().item()
    assert gap.max().item() > 1e3 * U * exact.abs().max().item()  # rounded, not float


def test_engine_entry_points_and_the_torch_fallback(monkeypatch):
    """decode_linear runs kind 3 for a weight marked int8_activations (and plain int4 otherwise);
    with KVTIDE_CPU_KERNELS=0 the torch path computes the same arithmetic."""
    w = torch.randn(48, 160, generator=torch.Generator().manual_seed(5))
    a8 = quantize_int4(w, 32, int8_activations=True)
    plain = quantize_int4(w, 32)
    assert torch.equal(a8.codes, plain.codes) and torch.equal(a8.scales, plain.scales)
    assert a8.rows(3, 9).int8_activations and a8.gather_rows(torch.tensor([1, 4])).int8_activations
    x = inputs(3, 160, seed=6)
    codes = torch.stack([torch.cat([row & 0x0F, row >> 4]) for row in a8.codes.reshape(-1, 16)]).reshape(48, 160)
    expected, mag = reference(x, codes, a8.scales, a8.mins, 32)
    tol = 200 * U
    compiled = cpu_kernels.decode_linear(x, a8)
    assert ((compiled.double() - expected).abs() / mag).max().item() <= tol
    float_act = cpu_kernels.decode_linear(x, plain)
    assert not torch.allclose(float_act, compiled, rtol=1e-5, atol=0)
    monkeypatch.setenv("KVTIDE_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_extension, "_loaded", {})
    monkeypatch.setattr(cpu_kernels, "_resolved", {})
    torch_path = cpu_kernels.decode_linear(x, a8)
    assert cpu_extension._loaded == {}
    assert ((torch_path.double() - expected).abs() / mag).max().item() <= tol


def test_int8_activations_are_for_int4_weights_only():
    with pytest.raises(ValueError, match="int8 activations are implemented for int4 weights, not int8"):
        QuantizedWeight("int8", torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 1), None, 64, 4, 64,
                        int8_activations=True)


def test_prefill_batches_compute_the_same_arithmetic():
    """Over DECODE_MAX_ROWS rows the layer runs float GEMMs (the rounded activations times s q, plus
    the groups' sums times the mins): the decode kernel's numbers, so a prompt scores as it decodes."""
    w = torch.randn(600, 192, generator=torch.Generator().manual_seed(7))  # two 512-row slices
    qw = quantize_int4(w, 64, int8_activations=True)
    x = inputs(70, 192, seed=8)
    codes = torch.stack([torch.cat([row & 0x0F, row >> 4]) for row in qw.codes.reshape(-1, 16)]).reshape(600, 192)
    expected, mag = reference(x, codes, qw.scales, qw.mins, 64)
    for out in (cpu_kernels.prefill_linear(x, qw), cpu_kernels.decode_linear(x, qw)):
        assert ((out.double() - expected).abs() / mag).max().item() <= 300 * U
