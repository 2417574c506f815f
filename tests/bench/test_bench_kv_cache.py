"""`kvtide bench kv-cache` on the tiny seeded Llama: the figures per dtype come from the engines it
loaded (blocks against bytes counted here), and bad flags fail before any model loads."""

from __future__ import annotations

import pytest
from torch_threads import one_torch_thread

from kvtide.bench.kv_cache import format_kv_cache, run_kv_cache_bench
from kvtide.cli import main as kvtide_main
from kvtide.engine_args import EngineArgs


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    yield from one_torch_thread()


def test_figures_per_dtype(llama_dir):
    """The tiny Llama: 4 layers, 2 KV heads of head_dim 32, so a token takes 4 x 2 x 2 x 32 x 4 bytes in
    float32 and 4 x 2 x (32 + 2 + 16 + 4) in k8v4."""
    engine = dict(dtype="float32", max_model_len=256, kv_cache_memory=1 << 20, attention_backend="torch",
                  enable_prefix_caching=False)
    result = run_kv_cache_bench(llama_dir, ["auto", "k8v4"], engine, input_len=48, output_len=8, num_prompts=3,
                                decode_batch=None, decode_steps=4)
    f32, k8v4 = result["results"]
    assert f32["num_blocks"] == (1 << 20) // (16 * 4 * 2 * 2 * 32 * 4)
    assert k8v4["num_blocks"] == (1 << 20) // (16 * 4 * 2 * (32 + 2 + 16 + 4))
    assert f32["seqs_fit"] == f32["num_blocks"] // 4 and k8v4["seqs_ratio"] == k8v4["seqs_fit"] / f32["seqs_fit"]
    assert f32["decode_batch"] == k8v4["decode_batch"] == min(f32["seqs_fit"], f32["num_blocks"] // 4)
    assert all(r["output_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 for r in result["results"])
    text = format_kv_cache(result)
    assert "k8v4" in text and "machine:" in text


def test_unknown_dtype_fails_before_loading(monkeypatch, capsys):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(EngineArgs, "resolve_model_dir", no_model)
    assert kvtide_main(["bench", "kv-cache", "--model", "demo", "--kv-cache-dtypes", "auto,int3"]) == 2
    assert "'int3' is not one of" in capsys.readouterr().err
