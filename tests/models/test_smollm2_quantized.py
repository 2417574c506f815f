"""What each weight quantization costs on the real model: perplexity of SmolLM2-135M-Instruct on a
fixed English text (tests/data/english.txt, 512 tokens) in float32, int8, int4 (g64, g32), w4a8
(g32), fp8, w8a8 and the GGUF's own Q4_1 kept quantized, measured by `kvtide bench quality`'s evaluator.

The float32 model is the GGUF dequantized to a float32 checkpoint (the only float SmolLM2 here), so
"float32" already carries Q4_1's rounding and the on-the-fly schemes quantize those values again.
int4 g128 does not apply: SmolLM2's hidden size, 576, is not a multiple of 128 (the engine refuses
it; checked below). Bounds: int8 within 1% of float32's perplexity and int4 g32 within 10% (the
targets the quantization work set); fp8 and w8a8 within 5% (their error sits between int8's and
int4's: 3 mantissa bits per weight, or 8-bit activations); the kept-quantized Q4_1 equal to
float32 up to summation order (the same weights)."""

from __future__ import annotations

import os

import pytest

from kvtide.bench.quality import evaluate_configurations
from kvtide.engine_args import EngineArgs

TEXT = os.path.join(os.path.dirname(__file__), "..", "data", "english.txt")
CALIBRATION = os.path.join(os.path.dirname(__file__), "..", "data", "calibration.txt")
"""w8a8's SmoothQuant factors come from other text than the one scored."""


@pytest.fixture(scope="module")
def smollm2_f32(smollm2_gguf, tmp_path_factory) -> str:
    from kvtide.models.gguf_checkpoint import export_hf_checkpoint

    return export_hf_checkpoint(smollm2_gguf, str(tmp_path_factory.mktemp("smollm2-f32")))


@pytest.fixture(scope="module")
def reports(smollm2_f32, smollm2_gguf):
    with open(TEXT, encoding="utf-8") as f:
        text = f.read()
    base = EngineArgs(model=smollm2_f32, device="cpu", dtype="float32", max_model_len=512)
    configurations = {
        "int8": base.replace(quantization="int8"),
        "int4-g64": base.replace(quantization="int4", quantization_group_size=64),
        "int4-g32": base.replace(quantization="int4", quantization_group_size=32),
        "w4a8-g32": base.replace(quantization="w4a8", quantization_group_size=32),
        "fp8": base.replace(quantization="fp8"),
        "w8a8": base.replace(quantization="w8a8", calibration_data=CALIBRATION),
        "gguf-q4_1": base.replace(model=smollm2_gguf),
    }
    results = evaluate_configurations(list(configurations.values()), text, base, context_length=256,
                                      max_tokens=1024)
    return dict(zip(configurations, results, strict=True))


def test_perplexity_of_each_quantization(reports):
    reference = reports["int8"].reference_perplexity
    ratio = {name: r.perplexity / reference for name, r in reports.items()}
    figures = ", ".join(f"{n} {r.perplexity:.3f} ({ratio[n]:.4f}x, KL {r.mean_kl:.2e}, top-1 {r.top1_agreement:.3f})"
                        for n, r in reports.items())
    print(f"\nSmolLM2-135M perplexity on tests/data/english.txt: float32 {reference:.3f}; {figures}")
    assert reports["int8"].tokens_scored > 500
    assert 5 < reference < 60  # a real model on English text, not noise
    assert abs(ratio["int8"] - 1) < 0.01
    assert ratio["int4-g32"] < 1.10
    assert ratio["fp8"] < 1.05 and ratio["w8a8"] < 1.05
    assert abs(ratio["gguf-q4_1"] - 1) < 1e-4 and reports["gguf-q4_1"].top1_agreement == 1.0
    # Finer groups cost less; every scheme moves the distribution (KL > 0) but keeps most argmaxes.
    assert reports["int4-g32"].mean_kl < reports["int4-g64"].mean_kl
    assert reports["int8"].mean_kl < reports["int4-g32"].mean_kl
    assert all(r.mean_kl > 0 and r.top1_agreement > 0.8 for n, r in reports.items()
               if n not in ("gguf-q4_1", "int4-g64", "w4a8-g32"))
    # w4a8: int4 g32's weights plus activations rounded per 32-block (measured 1.082x, KL 7.7e-2,
    # top-1 0.798 against int4 g32's 1.075x, 6.2e-2, 0.802): within int4's 10%, and a little further.
    assert ratio["w4a8-g32"] < 1.10 and reports["w4a8-g32"].top1_agreement > 0.75
    assert reports["w4a8-g32"].mean_kl > reports["int4-g32"].mean_kl
    assert reports["int4-g64"].top1_agreement > 0.6


def test_int4_group_128_is_refused_on_a_576_wide_model(smollm2_f32):
    with pytest.raises(ValueError, match=r"group size 128 does not divide the model's hidden_size \(576\)"):
        EngineArgs(model=smollm2_f32, quantization="int4", quantization_group_size=128).create_engine_config(
            smollm2_f32)
