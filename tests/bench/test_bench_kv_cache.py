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


def test_compare_hybrid_on_a_mixed_window_model(checkpoint_factory):
    """A Qwen2 with layers 0-1 full and 2-3 windowed (24 tokens), head_dim 16, 2 KV heads: a layer's
    token takes 2 x 2 x 16 x 4 = 256 bytes, so a one-table block (4 layers) 16 KiB and a group's (2)
    8 KiB. A 208-token sequence holds 13 blocks in one table; with groups 13 full ones and, in
    32-token steps, at most ceil((24 + 32 + 14) / 16) = 5 windowed ones."""
    mixed = checkpoint_factory("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=24, max_window_layers=2,
                               hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2)
    engine = dict(dtype="float32", max_model_len=256, kv_cache_memory=1 << 20, max_num_batched_tokens=32)
    result = run_kv_cache_bench(mixed, ["auto"], engine, input_len=200, output_len=8, num_prompts=2,
                                decode_batch=None, decode_steps=0, compare_hybrid=True)
    groups, one = result["results"]
    assert (groups["num_blocks"], groups["layer_groups"], groups["seqs_fit"]) == ((1 << 20) // 8192, 2, 128 // 18)
    assert (one["num_blocks"], one["layer_groups"], one["seqs_fit"]) == ((1 << 20) // 16384, 0, 64 // 13)
    assert one["seqs_ratio"] == 4 / 7
    assert "auto, groups" in format_kv_cache(result) and "auto, one table" in format_kv_cache(result)


def test_unknown_dtype_fails_before_loading(monkeypatch, capsys):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(EngineArgs, "resolve_model_dir", no_model)
    assert kvtide_main(["bench", "kv-cache", "--model", "demo", "--kv-cache-dtypes", "auto,int3"]) == 2
    assert "'int3' is not one of" in capsys.readouterr().err
