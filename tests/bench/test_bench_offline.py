"""`kvtide bench throughput|latency|compare` end to end on the tiny Llama, tiny workloads."""

from __future__ import annotations

import json

import pytest

from kvtide.bench.common import matmul_flops_per_token, workload_flops
from kvtide.cli import main as kvtide_main

SMALL_ENGINE = ["--kv-cache-memory", "64MiB", "--max-model-len", "256"]


def test_flop_count_of_the_bench_shape():
    config = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=2048, vocab_size=32000)
    layers, lm_head = matmul_flops_per_token(config)
    # Per layer: qkv 2*768*(768+2*256) + o 2*768*768 + mlp 2*3*768*2048.
    assert layers == 12 * (2 * 768 * 1280 + 2 * 768 * 768 + 6 * 768 * 2048)
    assert lm_head == 2 * 768 * 32000
    # W1 (64 x 128 in, 128 out) is about 2.9 TFLOP (shared/PEERS.md).
    total = workload_flops(config, [128] * 64, [128] * 64)
    assert total == pytest.approx(64 * (128 * layers + lm_head + 127 * (layers + lm_head)))
    assert 2.8e12 < total < 2.95e12


def test_throughput_end_to_end(llama_dir, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    rc = kvtide_main(["bench", "throughput", "--model", llama_dir, "--num-prompts", "3", "--input-len", "12",
                      "--output-len", "5", "--matmul-reps", "1", "--output-json", str(out), *SMALL_ENGINE])
    assert rc == 0
    result = json.loads(out.read_text())
    for engine in ("kvtide", "hf"):
        r = result[engine]
        assert r["output_tokens"] == 15 and r["prompt_tokens"] == 36
        assert r["output_tok_s"] > 0 and r["gflop_per_s"] > 0 and 0 < r["fraction_of_peak"]
    assert result["matmul_peak_gflop_per_s"] > 0 and result["kvtide_over_hf"] > 0
    assert result["greedy_agreement_with_hf"] == {"identical": 3, "of": 3, "mean_common_prefix": 5.0}
    assert "output tok/s" in capsys.readouterr().out


def test_throughput_module_entry_point_skip_hf(llama_dir, tmp_path):
    from kvtide.bench.throughput import main

    out = tmp_path / "t.json"
    assert main(["--model", llama_dir, "--num-prompts", "2", "--input-len", "4", "--output-len", "3",
                 "--skip-hf", "--skip-peak", "--no-warmup", "--profile", "--output-json", str(out),
                 *SMALL_ENGINE]) == 0
    result = json.loads(out.read_text())
    assert "hf" not in result and result["kvtide"]["output_tokens"] == 6
    profile = result["kvtide_profile"]
    # The linears show up under whichever GEMM kernel the chooser picked on this machine.
    gemm_ops = ("aten::mm", "aten::addmm", "aten::linear", "mkldnn::_linear_pointwise", "mkl::_mkl_linear")
    assert profile["top"] and 0 < profile["ops_ms"]
    assert any(row["op"] in gemm_ops or row["op"].endswith("::linear_panels") for row in profile["top"]), profile["top"]
    assert main(["--model", str(tmp_path / "nope")]) == 2


def test_latency_end_to_end(llama_dir, tmp_path):
    out = tmp_path / "latency.json"
    rc = kvtide_main(["bench", "latency", "--model", llama_dir, "--input-len", "10", "--output-len", "6",
                      "--num-iters", "2", "--num-iters-warmup", "1", "--output-json", str(out),
                      *SMALL_ENGINE])
    assert rc == 0
    r = json.loads(out.read_text())["kvtide"]
    assert r["num_iters"] == 2 and 0 < r["ttft_ms"] < r["e2e_ms"]
    assert r["tpot_ms"] == pytest.approx((r["e2e_ms"] - r["ttft_ms"]) / 5)
    assert r["tokens_per_s"] == pytest.approx(6000 / r["e2e_ms"])
    assert len(r["token_ids"]) == 6


def test_compare_end_to_end(llama_dir, tmp_path, capsys):
    out = tmp_path / "compare.json"
    rc = kvtide_main(["bench", "compare", "--model", llama_dir, "--engines", "kvtide,hf,vllm", "--repeats", "2",
                      "--vllm-python", str(tmp_path / "no-python"), "--pause", "0",
                      "--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--latency-input-len", "8",
                      "--latency-output-len", "4", "--num-iters", "1", "--log-dir", str(tmp_path / "logs"),
                      "--output-json", str(out), *SMALL_ENGINE])
    assert rc == 0
    summary = json.loads(out.read_text())
    assert summary["engines"]["kvtide"]["ok"] and summary["engines"]["hf"]["ok"]
    assert not summary["engines"]["vllm"]["ok"]  # a missing peer is skipped, not fatal
    tp = summary["figures"]["throughput"]["output_tok_s"]
    assert tp["kvtide"]["ratio_median"] == pytest.approx(1.0)
    assert len(tp["hf"]["values"]) == 2 and tp["hf"]["ratio_min"] <= tp["hf"]["ratio_median"] <= tp["hf"]["ratio_max"]
    assert "ttft_ms" in summary["figures"]["latency"]
    assert summary["greedy_agreement"]["hf"]["identical"] == 3
    # The order rotates over the repeats: each engine goes first once.
    firsts = [next(e for rep, e, _ in summary["run_order"] if rep == r) for r in (0, 1)]
    assert firsts == ["kvtide", "hf"]
    text = capsys.readouterr().out
    assert "ratio to kvtide" in text
