"""scripts/gpu_check.py without a GPU: its pure helpers, and (slow) the whole script on the CPU with
tiny shapes, so the GPU run fails only for GPU reasons."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("kvtide_gpu_check_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_parse_pytest_summary(gpu_check):
    out = "....F\n=== short test summary ===\nFAILED x\n1 failed, 84 passed, 1 skipped in 12.34s\n"
    assert gpu_check.parse_pytest_summary(out) == {"failed": 1, "passed": 84, "skipped": 1}
    assert gpu_check.parse_pytest_summary("3 passed, 2 errors in 1s") == {"passed": 3, "error": 2}
    assert gpu_check.parse_pytest_summary("no tests ran") == {}


def test_top_k_containment_and_prefix(gpu_check):
    topk = [[5, 1, 2], [7, 8, 9], [3, 4, 0]]
    assert gpu_check.first_uncontained([1, 9, 0], topk) is None
    assert gpu_check.first_uncontained([5, 6, 0], topk) == 1
    assert gpu_check.common_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2


def test_table_lines_up(gpu_check):
    rows = [gpu_check.Row("kernels", "tests/kernels on cuda", "PASS", "42 s", "85 passed"),
            gpu_check.Row("decode", "batch 1", "INFO", "7.10 ms/token")]
    lines = gpu_check.format_table(rows).splitlines()
    assert len(lines) == 4 and lines[0].startswith("section")
    assert lines[2].index("| PASS") == lines[3].index("| INFO")


def test_llama3_8b_shape_and_floor(gpu_check):
    config = gpu_check.llama3_8b_config()
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads, config.vocab_size) == \
        (4096, 32, 8, 128256)
    with torch.device("meta"):
        from kvtide.models.llama import LlamaForCausalLM

        model = LlamaForCausalLM(config, 1024, torch.bfloat16).to(torch.bfloat16)
    weight_bytes = gpu_check.weight_bytes_per_token(model)
    # 8.03e9 parameters in bf16, less the embedding table (128256 x 4096) but one row
    assert 14.9e9 < weight_bytes < 15.1e9
    assert gpu_check.floor_ms(weight_bytes, 4.0e12) == pytest.approx(weight_bytes / 4.0e9)


@pytest.mark.slow
def test_whole_script_on_cpu_with_tiny_shapes(gpu_check, capsys):
    status = gpu_check.main(["--device", "cpu", "--small", "--sections", "parity,decode,throughput",
                             "--batches", "2,4"])
    out = capsys.readouterr().out
    assert status == 0, out
    table = out[out.index("section "):]
    for item in ("float32 eager", "bfloat16 eager", "bandwidth floor", "batch 1 eager", "kvtide batch 4",
                 "HF generate batch 4"):
        assert item in table, table
