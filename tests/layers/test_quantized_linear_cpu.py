"""The compiled CPU kernels of quantized linears (layers/quantization/csrc/quantized_linear.cpp),
on every ISA build this CPU runs, against references written here from qweight.py's documented
layout (not from the code under test):

    w[n, k] = scales[n, k // g] * code[n, k] + (mins[n, k // g] if mins else 0)
    int4: in the 32-block at k0, byte k0 // 2 + j holds code k0 + j (low nibble), k0 + 16 + j (high)
    fp8:  the codes are float8_e4m3fn bit patterns

quantized_linear (x @ w.T, rows blocked 4 at a time, SIMD where the group is a multiple of the
vector width, a scalar loop elsewhere) and dequantize_rows (the prefill path's float32 rows); all
e4m3 bit patterns; the pure-torch fallbacks under KVTIDE_CPU_KERNELS=0; bad input; QuantizedWeight
validation; the int4 packing and `promote`."""

from __future__ import annotations

import pytest
import torch

from kvtide.attention import cpu_extension
from kvtide.attention.cpu_extension import available_isas, load_cpu_op
from kvtide.layers.quantization import cpu_kernels, weight_only
from kvtide.layers.quantization.qweight import (
    QuantizedWeight,
    dequantize,
    pack_int4,
    promote,
    quantize_fp8,
    unpack_int4,
)

ISAS = available_isas()
KIND = {"int8": 0, "int4": 1, "fp8": 2, "iq4": 4}
"""The op's `kind` argument, as the C++ source numbers them (kInt8, kInt4, kFp8, kIq4)."""
IQ4_GRID = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                        dtype=torch.float64)
"""GGUF's IQ4_NL levels (ggml's kvalues_iq4nl): an iq4 code is an index into them."""
U = 2.0 ** -24
"""float32 unit roundoff."""
NAN_PATTERNS = (0x7F, 0xFF)
"""The two e4m3fn NaNs (e4m3fn has no infinities)."""


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # test_thread_split_... sets two itself


def ops(isa: str):
    linear = load_cpu_op(cpu_kernels.SOURCE, "kvtide_quant", "quantized_linear", "quantized linear test", isa)
    rows = load_cpu_op(cpu_kernels.SOURCE, "kvtide_quant", "dequantize_rows", "quantized linear test", isa)
    if linear is None or rows is None:
        pytest.fail(f"the {isa} build of quantized_linear.cpp failed (see the warning logged)")
    return linear, rows


# ---- independent references ---------------------------------------------------------------------
def e4m3_value(bits: int) -> float:
    """float8_e4m3fn from its definition: 1 sign, 4 exponent (bias 7), 3 mantissa bits."""
    sign = -1.0 if bits & 0x80 else 1.0
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    if exponent == 0:
        return sign * 2.0 ** -6 * mantissa / 8
    return sign * 2.0 ** (exponent - 7) * (1 + mantissa / 8)


def my_unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The documented nibble order, element by element (slow, obviously right)."""
    n, half = packed.shape
    out = torch.empty(n, half * 2, dtype=torch.int64)
    p = packed.to(torch.int64)
    for k0 in range(0, half * 2, 32):
        for j in range(16):
            byte = p[:, k0 // 2 + j]
            out[:, k0 + j] = byte & 0x0F
            out[:, k0 + 16 + j] = byte >> 4
    return out


def code_numbers(qw: QuantizedWeight) -> torch.Tensor:
    """The codes as float64 numbers (N, K)."""
    if qw.kind == "int4":
        return my_unpack_int4(qw.codes).double()
    if qw.kind == "iq4":
        return IQ4_GRID[my_unpack_int4(qw.codes)]
    if qw.kind == "fp8":
        return qw.codes.view(torch.float8_e4m3fn).double()
    return qw.codes.double()


def exact_weight(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, |s q| + |m|) in float64: w = s * q + m exactly (float64 holds every such product and sum
    of these float32 operands within 2^-53 relative), and the magnitude its float32 roundings are
    proportional to (w itself can cancel to ~0 between s*q and a negative min)."""
    g = qw.group_size
    q = code_numbers(qw)
    s = qw.scales.double().repeat_interleave(g, dim=1)
    m = qw.mins.double().repeat_interleave(g, dim=1) if qw.mins is not None else torch.zeros_like(q)
    return s * q + m, (s * q).abs() + m.abs()


# Error bound of quantized_linear, relative to M = sum_k |x_k| (|s q_k| + |m_k|):
#   - the kernel's weight fl(s q + m) is one FMA (SIMD) or a multiply and an add (scalar loop):
#     within 2u (|s q| + |m|) of the exact w;
#   - a K-term float32 dot product errs by at most gamma_K = K u / (1 - K u) times sum |x| |w|
#     (vector lanes only shorten the chains; the horizontal sum is part of the K - 1 additions).
# So |out - x @ w| <= (K + 2) u M (1 + O(K u)); (K + 8) u absorbs the higher-order terms. This is a
# worst case (the typical error is ~sqrt(K) u); a wrong code, nibble, scale, min or group moves one
# term by a whole scale step, ~1 / (K * mean|q|) >= 3e-5 of M, above the bound (1.6e-5 at K = 256).
def linear_tolerance(k: int) -> float:
    return (k + 8) * U


def assert_linear_close(out: torch.Tensor, x: torch.Tensor, qw: QuantizedWeight, what: str) -> None:
    w, mag = exact_weight(qw)
    x64 = x.double()
    expected, scale = x64 @ w.T, x64.abs() @ mag.T
    err = ((out.double() - expected).abs() / scale.clamp_min(1e-300)).max().item()
    assert err <= linear_tolerance(qw.in_features), f"{what}: error {err:.3g} x sum|x|(|sq|+|m|)"


# ---- weights built by hand ----------------------------------------------------------------------
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _scales(n: int, groups: int, g: torch.Generator) -> torch.Tensor:
    """Positive scales that differ by row (1e-3..1, log-spaced) and by group, so a scale read from
    the wrong row or group shows."""
    rows = torch.logspace(-3, 0, n).unsqueeze(1)
    return (rows * (0.5 + torch.rand(n, groups, generator=g))).float().contiguous()


def make_weight(kind: str, n: int, k: int, group: int | None, mins: bool, seed: int) -> QuantizedWeight:
    g = _gen(seed)
    group = group or k
    groups = k // group
    if kind == "int8":
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)  # -128 too: checkpoints have it
    elif kind in ("int4", "iq4"):
        codes = _pack_by_hand(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8))
    else:
        codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
        nan = (codes & 0x7F) == 0x7F
        codes[nan] = torch.randint(0, 0x7F, (int(nan.sum()),), generator=g, dtype=torch.uint8)
    scales = _scales(n, groups, g)
    min_t = None
    if mins:  # offsets of either sign, the size of a few steps: s q and m partly cancel
        min_t = (torch.randn(n, groups, generator=g) * scales * 8).float().contiguous()
    return QuantizedWeight(kind, codes, scales, min_t, group, n, k)


def _pack_by_hand(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 -> (N, K // 2) bytes in the documented order, element by element."""
    n, k = codes.shape
    out = torch.zeros(n, k // 2, dtype=torch.uint8)
    for k0 in range(0, k, 32):
        for j in range(16):
            out[:, k0 // 2 + j] = codes[:, k0 + j] | (codes[:, k0 + 16 + j] << 4)
    return out


# (kind, group or None for per-channel, mins, the K values it is tested at)
WEIGHT_CASES = {
    "int8-channel": ("int8", None, False, (64, 100, 256)),  # K=100: group % lanes != 0 -> scalar loop
    "int8-g32": ("int8", 32, False, (64, 256)),
    "int8-g16-mins": ("int8", 16, True, (64, 256)),  # the Q6_K shape, with hand-made mins
    "int4-g32": ("int4", 32, True, (64, 256)),
    "int4-g32-no-mins": ("int4", 32, False, (64,)),
    "int4-g64": ("int4", 64, True, (64, 256)),
    "int4-g128": ("int4", 128, True, (256,)),
    "int4-channel": ("int4", None, True, (64, 256)),
    "int4-g16": ("int4", 16, True, (64, 256)),  # GGUF's Q2_K / Q3_K sub-blocks
    "iq4-g32": ("iq4", 32, False, (64, 256)),  # GGUF's IQ4_NL / IQ4_XS
    "iq4-channel": ("iq4", None, False, (256,)),
    "fp8-channel": ("fp8", None, False, (64, 100, 256)),  # K=100: scalar loop
    "fp8-g32": ("fp8", 32, False, (256,)),
}
CASES = [(name, k) for name, (*_, ks) in WEIGHT_CASES.items() for k in ks]
CASE_IDS = [f"{name}-k{k}" for name, k in CASES]
ROWS = (1, 2, 3, 4, 5, 9)
"""Every remainder of the kernel's 4-row blocks, one and several blocks."""
OUTS = (1, 17, 96)


def case_weight(name: str, k: int, n: int, seed: int) -> QuantizedWeight:
    kind, group, mins, _ = WEIGHT_CASES[name]
    return make_weight(kind, n, k, group, mins, seed)


def run_linear(op, x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    out = torch.full((x.shape[0], qw.out_features), float("nan"))
    op(out, x, qw.codes, qw.scales, qw.mins, KIND[qw.kind], qw.group_size)
    return out


def run_rows(op, qw: QuantizedWeight) -> torch.Tensor:
    out = torch.full((qw.out_features, qw.in_features), float("nan"))
    op(out, qw.codes, qw.scales, qw.mins, KIND[qw.kind], qw.group_size)
    return out


# ---- quantized_linear and dequantize_rows -------------------------------------------------------
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name,k", CASES, ids=CASE_IDS)
def test_quantized_linear_equals_the_float64_product(isa, name, k):
    linear, _ = ops(isa)
    for n in OUTS:
        qw = case_weight(name, k, n, seed=k + n)
        for m in ROWS:
            x = torch.randn(m, k, generator=_gen(100 * m + n))
            out = run_linear(linear, x, qw)
            assert_linear_close(out, x, qw, f"{isa} {name} M={m} N={n} K={k}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name,k", CASES, ids=CASE_IDS)
def test_dequantize_rows_equals_qweight_dequantize(isa, name, k):
    _, rows = ops(isa)
    qw = case_weight(name, k, 33, seed=k)
    out = run_rows(rows, qw)
    exact, mag = exact_weight(qw)
    reference = dequantize(qw)
    # Each side rounds s*q+m to float32 at most twice: within 2u(|sq|+|m|) of the exact value.
    assert ((out.double() - exact).abs() <= 2 * U * mag).all(), f"{isa} {name}: kernel vs exact"
    assert ((reference.double() - exact).abs() <= 2 * U * mag).all(), f"{name}: qweight.dequantize vs exact"
    if qw.mins is None:  # one rounding of s*q on both sides (the FMA adds +0): bit-equal values
        assert torch.equal(out, reference)
    else:  # the kernel fuses s*q+m in one FMA, torch rounds s*q first
        assert ((out.double() - reference.double()).abs() <= 4 * U * mag).all()


@pytest.mark.parametrize("isa", ISAS)
def test_row_slices_and_non_contiguous_x(isa):
    """`QuantizedWeight.rows` (views the prefill path dequantizes) and a strided x (decode_linear
    makes it contiguous) give the same numbers as the whole weight."""
    linear, rows = ops(isa)
    qw = case_weight("int4-g32", 256, 96, seed=3)
    part = qw.rows(17, 80)
    x = torch.randn(5, 512, generator=_gen(4))[:, ::2]
    assert not x.is_contiguous()
    assert_linear_close(run_linear(linear, x.contiguous(), part), x, part, f"{isa} rows(17, 80)")
    assert torch.equal(run_rows(rows, part), run_rows(rows, qw)[17:80])
    assert_linear_close(cpu_kernels.decode_linear(x, part), x, part, "decode_linear, strided x")


@pytest.mark.parametrize("isa", ISAS)
def test_every_e4m3_bit_pattern_decodes_exactly(isa):
    """All 254 finite e4m3fn patterns (the subnormals, both zeros, +-448) through both kernel paths:
    K = 254 (per-channel group 254: the scalar loop on every ISA) and K = 256 with the NaNs replaced
    by 0 and each row rotated (the vector decode where the build has one, every pattern at every
    lane position)."""
    linear, rows = ops(isa)
    finite = torch.tensor([b for b in range(256) if b not in NAN_PATTERNS], dtype=torch.uint8)
    by_definition = torch.tensor([e4m3_value(int(b)) for b in finite], dtype=torch.float32)
    torch_values = finite.view(torch.float8_e4m3fn).float()
    assert torch.equal(torch_values, by_definition)  # the two references agree
    assert torch_values.abs().max() == 448 and (torch_values.abs() < 2 ** -6).sum() == 16  # 7+7 subnormals, +-0

    qw = QuantizedWeight("fp8", finite.unsqueeze(0), torch.ones(1, 1), None, 254, 1, 254)
    assert torch.equal(run_rows(rows, qw)[0], torch_values)
    assert torch.equal(dequantize(qw)[0], torch_values)

    all_bits = torch.arange(256, dtype=torch.int64)
    all_bits[list(NAN_PATTERNS)] = 0
    codes = torch.stack([all_bits.roll(7 * i) for i in range(16)]).to(torch.uint8)  # (16, 256)
    qw16 = QuantizedWeight("fp8", codes, torch.ones(16, 1), None, 256, 16, 256)
    expected = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(run_rows(rows, qw16), expected)
    # x = identity reads each decoded code back through the linear: one product per output.
    for kernel_qw, k in ((qw, 254), (qw16, 256)):
        out = run_linear(linear, torch.eye(k), kernel_qw)
        assert torch.equal(out.T, kernel_qw.codes.view(torch.float8_e4m3fn).float()), f"{isa} K={k}"


def test_thread_split_does_not_change_the_result():
    """Each output is one thread's dot product whatever the split over output rows: 1 and 2
    threads give bit-equal results (N = 600: several chunks of the parallel loop)."""
    linear, rows = ops(ISAS[0])
    qw = case_weight("int8-g16-mins", 256, 600, seed=8)
    x = torch.randn(9, 256, generator=_gen(9))
    one = run_linear(linear, x, qw), run_rows(rows, qw)
    torch.set_num_threads(2)
    try:
        two = run_linear(linear, x, qw), run_rows(rows, qw)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


# ---- the Python entry points and their pure-torch fallbacks --------------------------------------
def _entry_point_weights() -> list[QuantizedWeight]:
    return [case_weight("int8-channel", 100, 37, seed=1), case_weight("int4-g32", 64, 600, seed=2),
            case_weight("fp8-channel", 256, 40, seed=3), case_weight("int8-g16-mins", 64, 530, seed=4)]


def test_decode_and_prefill_linear_fall_back_to_pure_torch_with_the_same_numbers(monkeypatch):
    """With the kernels: decode_linear (the op) and prefill_linear (dequantize_rows + GEMM, N = 600
    and 530 span two 512-row slices); with KVTIDE_CPU_KERNELS=0 both run in torch. All four agree
    with the float64 product and with each other."""
    assert cpu_kernels.kernels_available()
    weights = _entry_point_weights()
    xs = [torch.randn(m, qw.in_features, generator=_gen(m)) for qw, m in zip(weights, (3, 70, 1, 65), strict=True)]
    compiled = [(cpu_kernels.decode_linear(x, qw), cpu_kernels.prefill_linear(x, qw))
                for x, qw in zip(xs, weights, strict=True)]
    monkeypatch.setenv("KVTIDE_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_extension, "_loaded", {})
    monkeypatch.setattr(cpu_kernels, "_resolved", {})
    assert not cpu_kernels.kernels_available()
    assert cpu_kernels._op("dequantize_rows") is None
    for x, qw, (decode_c, prefill_c) in zip(xs, weights, compiled, strict=True):
        decode_t, prefill_t = cpu_kernels.decode_linear(x, qw), cpu_kernels.prefill_linear(x, qw)
        assert cpu_extension._loaded == {}  # nothing was built or loaded
        for out, what in ((decode_c, "decode kernel"), (prefill_c, "prefill kernel"),
                          (decode_t, "decode torch"), (prefill_t, "prefill torch")):
            assert out.shape == (x.shape[0], qw.out_features)
            assert_linear_close(out, x, qw, f"{qw.kind} {what}")


LAYER_ROWS = (3, weight_only.DECODE_MAX_ROWS, weight_only.DECODE_MAX_ROWS + 1, 2 * weight_only.DECODE_MAX_ROWS + 5)
"""Each side of the decode/prefill threshold."""


@pytest.mark.parametrize("rows", LAYER_ROWS, ids=lambda r: f"{r}rows")
def test_layer_matmul_with_bias_permutation_and_3d_input(rows, monkeypatch):
    """weight_only.quantized_linear, the layers' forward: up to DECODE_MAX_ROWS rows through the
    op, more through dequantize + GEMM; x (1, rows, K) gathered by input_perm, plus bias."""
    calls = []
    for name in ("decode_linear", "prefill_linear"):
        original = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda x, qw, _f=original, _n=name: calls.append(_n) or _f(x, qw))
    base = case_weight("int4-g32", 128, 48, seed=rows)
    perm = torch.randperm(128, generator=_gen(5))
    qw = QuantizedWeight(base.kind, base.codes, base.scales, base.mins, 32, 48, 128, perm)
    x = torch.randn(1, rows, 128, generator=_gen(6))
    bias = torch.randn(48, generator=_gen(7))
    out = weight_only.quantized_linear(x, qw, bias)
    assert out.shape == (1, rows, 48)
    assert calls == ["decode_linear" if rows <= weight_only.DECODE_MAX_ROWS else "prefill_linear"]
    flat = x.reshape(-1, 128)[:, perm]
    w, mag = exact_weight(qw)
    expected = flat.double() @ w.T + bias.double()
    scale = flat.double().abs() @ mag.T + bias.double().abs()
    err = ((out.reshape(-1, 48).double() - expected).abs() / scale).max().item()
    assert err <= linear_tolerance(128) + U, err  # + the bias addition's rounding


# ---- bad input -----------------------------------------------------------------------------------
def _op_bad_inputs():
    qw8 = case_weight("int8-g32", 64, 8, seed=1)
    qw4 = case_weight("int4-g32", 64, 8, seed=2)
    x = torch.randn(2, 64)
    out = torch.empty(2, 8)
    base8 = dict(out=out, x=x, codes=qw8.codes, scales=qw8.scales, mins=None, kind=0, group=32)
    base4 = dict(out=out, x=x, codes=qw4.codes, scales=qw4.scales, mins=qw4.mins, kind=1, group=32)
    return {  # name: (arguments, the message the op must name)
        "int16 codes": ({**base8, "codes": qw8.codes.to(torch.int16)}, "codes must be int8"),
        "float codes": ({**base8, "codes": qw8.codes.float()}, "codes must be int8"),
        "uint8 codes for int8": ({**base8, "codes": qw8.codes.view(torch.uint8)}, "codes must be int8"),
        "int8 codes for int4": ({**base4, "codes": torch.zeros(8, 32, dtype=torch.int8)}, "codes must be uint8"),
        "codes one column short": ({**base8, "codes": qw8.codes[:, :63].contiguous()}, "64 bytes per row"),
        "int4 codes unpacked": ({**base4, "codes": torch.zeros(8, 64, dtype=torch.uint8)}, "32 bytes per row"),
        "3-D codes": ({**base8, "codes": qw8.codes.unsqueeze(-1)}, "codes must be int8"),
        "strided codes": ({**base8, "codes": torch.zeros(8, 128, dtype=torch.int8)[:, ::2]}, "contiguous"),
        "group 24 does not divide 64": ({**base8, "scales": torch.ones(8, 2), "group": 24},
                                        "group size must divide K"),
        "group 0": ({**base8, "group": 0}, "group size must divide K"),
        "int4 group 8": ({**base4, "scales": torch.ones(8, 8), "mins": torch.zeros(8, 8), "group": 8},
                         "int4 groups must be 16 or multiples of 32"),
        "int8 activations in groups of 16": ({**base4, "scales": torch.ones(8, 4), "mins": torch.zeros(8, 4),
                                              "group": 16, "kind": 3}, "int8 activations need int4 groups"),
        "scales per channel for group 32": ({**base8, "scales": torch.ones(8, 1)},
                                            r"scales must be \(N, K / group\)"),
        "float64 scales": ({**base8, "scales": qw8.scales.double()}, "scales must be float32"),
        "mins of the wrong shape": ({**base4, "mins": torch.zeros(8, 1)}, "mins must be float32 like scales"),
        "float64 mins": ({**base4, "mins": qw4.mins.double()}, "mins must be float32 like scales"),
        "unknown kind": ({**base8, "kind": 5}, "unknown quantized kind 5"),
        "float64 x": ({**base8, "x": x.double()}, "x and out must be float32"),
        "out of the wrong shape": ({**base8, "out": torch.empty(2, 9)}, r"out must be \(M, N\)"),
        "strided x": ({**base8, "x": torch.randn(2, 128)[:, ::2]}, "x and out must be contiguous 2-D"),
    }


@pytest.mark.parametrize("isa", ISAS)
def test_bad_input_to_the_ops_raises_naming_the_problem(isa):
    linear, rows = ops(isa)
    for name, (a, message) in _op_bad_inputs().items():
        with pytest.raises(RuntimeError, match=message):
            linear(a["out"], a["x"], a["codes"], a["scales"], a["mins"], a["kind"], a["group"])
            pytest.fail(f"quantized_linear accepted {name}")
        if name in ("float64 x", "out of the wrong shape", "strided x"):
            continue  # dequantize_rows has no x, and takes N and K from out
        with pytest.raises(RuntimeError, match=message):
            rows(torch.empty(8, 64), a["codes"], a["scales"], a["mins"], a["kind"], a["group"])
            pytest.fail(f"dequantize_rows accepted {name}")
    with pytest.raises(RuntimeError, match="codes and out differ in rows"):
        rows(torch.empty(9, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 1), None, 0, 64)
    with pytest.raises(RuntimeError, match=r"out: float32 \(N, K\)"):
        rows(torch.empty(8, 64, dtype=torch.float64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 1),
             None, 0, 64)


def _qw_kwargs(**changes):
    kwargs = dict(kind="int4", codes=torch.zeros(4, 32, dtype=torch.uint8), scales=torch.ones(4, 2),
                  mins=torch.zeros(4, 2), group_size=32, out_features=4, in_features=64)
    kwargs.update(changes)
    return kwargs


QW_BAD = {
    "kind int3": (dict(kind="int3"), "kind must be one of int8, int4, fp8"),
    "group 0": (dict(group_size=0), "group size 0 does not divide"),
    "group 48 of K 64": (dict(group_size=48, scales=torch.ones(4, 1), mins=torch.zeros(4, 1)),
                         "group size 48 does not divide the input dimension 64"),
    "int4 group 8": (dict(group_size=8, scales=torch.ones(4, 8), mins=torch.zeros(4, 8)), "multiples of 32"),
    "int8 activations in groups of 16": (dict(group_size=16, scales=torch.ones(4, 4), mins=torch.zeros(4, 4),
                                              int8_activations=True), "int8 activations need int4 groups"),
    "int4 K 48": (dict(in_features=48, group_size=48, codes=torch.zeros(4, 24, dtype=torch.uint8),
                       scales=torch.ones(4, 1), mins=torch.zeros(4, 1)), "multiples of 32"),
    "int4 codes unpacked": (dict(codes=torch.zeros(4, 64, dtype=torch.uint8)), r"torch.uint8 \(4, 32\)"),
    "int4 codes int8": (dict(codes=torch.zeros(4, 32, dtype=torch.int8)), "codes must be torch.uint8"),
    "int8 codes uint8": (dict(kind="int8", codes=torch.zeros(4, 64, dtype=torch.uint8)), "codes must be torch.int8"),
    "fp8 codes float8": (dict(kind="fp8", codes=torch.zeros(4, 64, dtype=torch.float8_e4m3fn)),
                         "codes must be torch.uint8"),
    "codes rows": (dict(codes=torch.zeros(5, 32, dtype=torch.uint8)), r"got torch.uint8 \(5, 32\)"),
    "scales shape": (dict(scales=torch.ones(4, 1)), r"scales must be float32 \(4, 2\)"),
    "scales float16": (dict(scales=torch.ones(4, 2, dtype=torch.float16)), "scales must be float32"),
    "mins shape": (dict(mins=torch.zeros(2, 4)), r"mins must be float32 \(4, 2\)"),
    "input_perm length": (dict(input_perm=torch.arange(63)), "input_perm must have 64 entries"),
}


@pytest.mark.parametrize("case", list(QW_BAD), ids=list(QW_BAD))
def test_quantized_weight_validation(case):
    changes, message = QW_BAD[case]
    QuantizedWeight(**_qw_kwargs())  # the unchanged arguments are valid
    with pytest.raises(ValueError, match=message):
        QuantizedWeight(**_qw_kwargs(**changes))


# ---- int4 packing and promote --------------------------------------------------------------------
def test_pack_int4_follows_the_documented_nibble_order():
    # Block 0 (k 0..31): codes 0, 1, ..., 15, then 15, 14, ..., 0; block 1 (k 32..63): 16 threes
    # then 16 nines. Byte k0/2 + j = code[k0 + j] | code[k0 + 16 + j] << 4, written out:
    codes = torch.tensor([list(range(16)) + list(range(15, -1, -1)) + [3] * 16 + [9] * 16])
    expected = [0xF0, 0xE1, 0xD2, 0xC3, 0xB4, 0xA5, 0x96, 0x87, 0x78, 0x69, 0x5A, 0x4B, 0x3C, 0x2D, 0x1E, 0x0F] + \
        [0x93] * 16
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.tolist() == [expected]
    assert unpack_int4(packed).tolist() == codes.tolist()
    # The kernels read the same order: scale 1, no mins gives the codes back.
    qw = QuantizedWeight("int4", torch.tensor([expected], dtype=torch.uint8), torch.ones(1, 2), None, 32, 1, 64)
    for isa in ISAS:
        linear, rows = ops(isa)
        assert run_rows(rows, qw).tolist() == codes.float().tolist(), isa
        assert run_linear(linear, torch.eye(64), qw).T.tolist() == codes.float().tolist(), isa
    with pytest.raises(ValueError, match="K % 32 == 0"):
        pack_int4(torch.zeros(2, 48, dtype=torch.uint8))


def test_pack_unpack_int4_round_trip():
    g = _gen(11)
    for n, k in ((1, 32), (7, 64), (33, 256)):
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int64)
        packed = pack_int4(codes)
        assert packed.shape == (n, k // 2)
        assert torch.equal(packed, _pack_by_hand(codes.to(torch.uint8)))
        assert torch.equal(unpack_int4(packed), codes.to(torch.uint8))
        assert torch.equal(my_unpack_int4(packed), codes)
    every_byte = torch.arange(256, dtype=torch.int64).to(torch.uint8).reshape(16, 16)
    packed = torch.cat([every_byte, every_byte.flip(1)], dim=1)  # (16, 32): every byte value
    assert torch.equal(pack_int4(unpack_int4(packed)), packed)


PROMOTIONS = [  # (source case, K, target kind, target group)
    ("int4-g32", 64, "int8", 16),  # a Q4_K shard beside a Q6_K one
    ("int4-g32", 64, "int8", 32),
    ("int4-g32-no-mins", 64, "int8", 32),  # the shift of 8 becomes the mins
    ("int4-g128", 256, "int4", 32),
    ("int4-channel", 256, "int8", 16),
    ("int4-g16", 64, "int8", 16),  # Q2_K/Q3_K on an accelerator, or beside a Q6_K shard
    ("int8-g32", 64, "int8", 16),
    ("int8-g16-mins", 64, "int8", 16),
    ("fp8-channel", 256, "fp8", 64),
]


@pytest.mark.parametrize("source,k,kind,group", PROMOTIONS,
                         ids=[f"{s}-to-{t}-g{g}" for s, _, t, g in PROMOTIONS])
def test_promote_preserves_the_dequantized_values(source, k, kind, group):
    qw = case_weight(source, k, 24, seed=k + group)
    promoted = promote(qw, kind, group)
    assert (promoted.kind, promoted.group_size) == (kind, group)
    assert promoted.scales.shape == (24, k // group)
    before, mag = exact_weight(qw)
    after, _ = exact_weight(promoted)
    if qw.kind == kind:  # codes and per-group numbers are copied: identical values
        assert torch.equal(after, before)
    else:
        # int4 -> int8: codes q - 8 in -8..7, mins m + 8 s; the one new rounding is m + 8s's (8s is
        # exact), at most u (|m| + 8 |s|) <= u (|sq| + |m| + 8 s) per element.
        assert promoted.codes.dtype == torch.int8 and int(promoted.codes.min()) >= -8
        assert int(promoted.codes.max()) <= 7
        s = qw.scales.double().repeat_interleave(qw.group_size, dim=1)
        assert ((after - before).abs() <= U * (mag + 8 * s)).all()
    # The promoted weight runs through the kernels to the same numbers.
    linear, rows = ops(ISAS[0])
    x = torch.randn(5, k, generator=_gen(1))
    assert_linear_close(run_linear(linear, x, promoted), x, qw, f"promoted {source}")


def test_promote_writes_iq4_levels_as_int8_codes():
    """iq4 -> int8 (a fused layer mixing IQ4 with other GGUF types, or an accelerator): the levels
    become the codes, every value exact."""
    qw = case_weight("iq4-g32", 64, 24, seed=5)
    promoted = promote(qw, "int8", 16)
    assert promoted.codes.dtype == torch.int8 and promoted.mins is None
    assert set(promoted.codes.unique().tolist()) <= set(IQ4_GRID.long().tolist())
    assert torch.equal(exact_weight(promoted)[0], exact_weight(qw)[0])
    with pytest.raises(ValueError, match="cannot promote a iq4 weight to int4"):
        promote(qw, "int4", 32)


def test_promote_refuses_what_it_cannot_represent():
    qw4 = case_weight("int4-g32", 64, 4, seed=1)
    with pytest.raises(ValueError, match="cannot regroup group size 32 into 64"):
        promote(qw4, "int4", 64)
    with pytest.raises(ValueError, match="cannot promote a int8 weight to int4"):
        promote(case_weight("int8-g32", 64, 4, seed=1), "int4", 32)
    with pytest.raises(ValueError, match="cannot promote a fp8 weight to int8"):
        promote(case_weight("fp8-channel", 64, 4, seed=1), "int8", 64)
    with pytest.raises(ValueError, match="multiples of 32"):  # int4 groups of 8 do not exist
        promote(qw4, "int4", 8)


def test_fp8_weights_with_nan_codes_are_refused_at_load():
    """The kernels read every e4m3 code as a number; a NaN code (0x7F, 0xFF) can only come from a
    corrupt checkpoint, so loading refuses it instead of computing with it."""
    from kvtide.layers.quantization.fp8_method import Fp8Method

    good = quantize_fp8(torch.randn(4, 32))
    assert Fp8Method(lambda layer: good).process_weights_after_loading(None) is good
    for nan in NAN_PATTERNS:
        codes = good.codes.clone()
        codes[1, 3] = nan
        bad = QuantizedWeight("fp8", codes, good.scales, None, 32, 4, 32)
        with pytest.raises(ValueError, match="NaN codes"):
            Fp8Method(lambda layer, bad=bad: bad).process_weights_after_loading(None)
