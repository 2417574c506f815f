"""`kvtide bench throughput --output-json` also writes `vllm bench throughput`'s keys, consistent
with kvtide's own figures."""

from __future__ import annotations

import json

import pytest

from kvtide.cli import main as kvtide_main

VLLM_KEYS = ("elapsed_time", "num_requests", "total_num_tokens", "requests_per_second", "tokens_per_second")


def test_throughput_json_has_vllms_keys(llama_dir, tmp_path):
    out = tmp_path / "throughput.json"
    rc = kvtide_main(["bench", "throughput", "--model", llama_dir, "--num-prompts", "3", "--input-len", "7",
                      "--output-len", "4", "--skip-hf", "--skip-peak", "--no-warmup", "--output-json", str(out),
                      "--kv-cache-memory", "64MiB", "--max-model-len", "256"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert all(key in result for key in VLLM_KEYS), sorted(result)
    # The requested workload: 3 requests of 7 prompt and 4 output tokens (EOS is ignored).
    assert result["num_requests"] == 3
    assert result["total_num_tokens"] == 3 * (7 + 4)
    assert isinstance(result["num_requests"], int) and isinstance(result["total_num_tokens"], int)
    elapsed = result["elapsed_time"]
    assert elapsed > 0
    assert result["requests_per_second"] * elapsed == pytest.approx(result["num_requests"])
    assert result["tokens_per_second"] * elapsed == pytest.approx(result["total_num_tokens"])
    # The same run as kvtide's own figures, and the existing keys are still there.
    kvtide = result["kvtide"]
    assert elapsed == kvtide["elapsed_s"]
    assert result["total_num_tokens"] == kvtide["prompt_tokens"] + kvtide["output_tokens"]
    assert result["requests_per_second"] == pytest.approx(kvtide["requests_per_s"])
    assert result["tokens_per_second"] == pytest.approx(kvtide["total_tok_s"])
    assert result["num_prompts"] == 3 and "hf" not in result
