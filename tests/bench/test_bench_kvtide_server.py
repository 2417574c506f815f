"""`kvtide bench serve` against a live `kvtide serve` on 127.0.0.1 (the tiny Llama)."""

from __future__ import annotations

import json
import sys

import pytest

from kvtide.bench import peers
from kvtide.cli import main as kvtide_main

pytest.importorskip("kvtide.server.cli")


def test_bench_serve_against_kvtide_serve(llama_dir, tmp_path):
    port = peers.free_port()
    cmd = peers.server_command("kvtide", sys.executable, llama_dir, port, 256, 2,
                               extra=["--kv-cache-memory", "64MiB", "--log-level", "warning"])
    server = peers.ServerProcess("kvtide", cmd, peers.peer_env("kvtide", 2), port, str(tmp_path))
    try:
        ready = server.wait_ready(120)
        assert ready["ok"], ready
        out = tmp_path / "serve.json"
        rc = kvtide_main(["bench", "serve", "--base-url", server.url, "--tokenizer", llama_dir,
                          "--dataset-name", "shared-prefix", "--num-prompts", "6", "--num-prefixes", "2",
                          "--prefix-len", "48", "--suffix-len", "4", "--output-len", "4", "--max-concurrency", "3",
                          "--disable-tqdm", "--output-json", str(out)])
        assert rc == 0
        result = json.loads(out.read_text())
        # `bench compare`'s serve workload against the same live server, given by URL.
        compare_out = tmp_path / "compare.json"
        assert kvtide_main(["bench", "compare", "--model", llama_dir, "--engines", "kvtide,hf", "--workloads",
                            "serve", "--kvtide-url", server.url, "--repeats", "2", "--num-prompts", "3",
                            "--input-len", "8", "--output-len", "3", "--pause", "0",
                            "--output-json", str(compare_out)]) == 0
        summary = json.loads(compare_out.read_text())
    finally:
        server.close()
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["ignore_eos"] is True and result["total_output_tokens"] == 24
    assert result["median_ttft_ms"] > 0 and result["server_metrics"] is True
    # Two prefixes of 48 tokens over six requests: at least the later ones hit the prefix cache.
    assert result["prefix_cache_hit_rate"] is not None and result["prefix_cache_hit_rate"] > 0.2
    assert result["num_preemptions"] == 0
    serve = summary["figures"]["serve"]["output_throughput"]["kvtide"]
    assert len(serve["values"]) == 2 and serve["ratio_median"] == 1.0
    assert summary["engines"]["hf-server"]["ok"] is False  # HF has no server: reported, not fatal
