"""`kvtide bench moe-op` in process on a tiny shape, one iteration: the table has a row per token
count with positive times and their ratio, the dense MLP is sized to the active parameters, and
bad flags fail with exit status 2 before anything runs."""

from __future__ import annotations

import json

import pytest
from torch_threads import one_torch_thread

from kvtide.bench import moe_op
from kvtide.bench.moe_op import format_moe_op, run_moe_op_bench
from kvtide.cli import main as kvtide_main


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    yield from one_torch_thread()


def test_figures_per_token_count():
    result = run_moe_op_bench(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16,
                              shared_intermediate_size=8, tokens=[1, 5], iters=1, warmup=0)
    assert result["dense_intermediate_size"] == 2 * 16 + 8
    rows = result["results"]
    assert [r["tokens"] for r in rows] == [1, 5]
    for r in rows:
        assert r["moe_ms"] > 0 and r["dense_ms"] > 0
        assert r["ratio"] == pytest.approx(r["moe_ms"] / r["dense_ms"])
        # each side's figure is its fastest kernel's, the compiled experts call among the MoE's
        assert set(r["moe_ms_by_kernel"]) == {"torch", "panels"}
        assert r["moe_ms"] == min(r["moe_ms_by_kernel"].values())
        assert r["dense_ms"] == min(r["dense_ms_by_kernel"].values())
    text = format_moe_op(result)
    assert text.splitlines()[0].startswith("machine: ") and "ISA" in text.splitlines()[0]


def test_the_command_prints_the_table(capsys, tmp_path):
    out_json = tmp_path / "moe.json"
    status = kvtide_main(["bench", "moe-op", "--num-experts", "4", "--top-k", "1", "--hidden-size", "32",
                          "--intermediate-size", "16", "--tokens", "1,8,3", "--iters", "1", "--warmup", "0",
                          "--output-json", str(out_json)])
    assert status == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("machine: ")
    assert "E=4 k=1 H=32 I=16 vs dense MLP I=16" in lines[1]
    header = lines.index(next(line for line in lines if line.startswith("tokens")))
    assert lines[header].split() == ["tokens", "moe", "ms", "(kernel)", "dense", "ms", "(kernel)", "ratio"]
    table = [line.split() for line in lines[header + 1:header + 4]]
    assert [row[0] for row in table] == ["1", "8", "3"]
    for row in table:
        moe_ms, dense_ms, ratio = float(row[1]), float(row[3]), float(row[5])
        assert moe_ms > 0 and dense_ms > 0 and ratio > 0
        assert row[2] in ("torch", "panels") and row[4] in ("f.linear", "weight-major", "panels")
    assert lines[header + 4].startswith("target moe <= 1.5x dense")
    saved = json.loads(out_json.read_text())
    assert [r["tokens"] for r in saved["results"]] == [1, 8, 3] and saved["machine"]["isa"]


@pytest.mark.parametrize("flags,message", [
    (["--tokens", "1,0"], "token counts >= 1"),
    (["--tokens", "1,x"], "comma-separated list"),
    (["--top-k", "9"], "--top-k must be in"),
    (["--iters", "0"], ">= 1"),
])
def test_bad_flags_fail_before_running(monkeypatch, capsys, flags, message):
    def no_run(*args, **kwargs):
        raise AssertionError("the bench ran")

    monkeypatch.setattr(moe_op, "run_moe_op_bench", no_run)
    assert kvtide_main(["bench", "moe-op", *flags]) == 2
    assert message in capsys.readouterr().err
