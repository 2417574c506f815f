"""The compiled CPU paged-attention kernel (cpu backend) equals the reference backend (torch_ref.py)
on random paged batches, on every ISA build this machine runs and on the pure-torch fallback: block
sizes 16-128, GQA ratios 1-8, head dims 64-256, sliding windows, multi-token rows over a cached
context, single-token contexts, contexts split into partitions, no rows at all; bad input raises."""

from __future__ import annotations

import pytest
import torch
from paged_batches import make_paged_batch

from kvtide.attention import cpu_backend, cpu_extension
from kvtide.attention.cpu_backend import CpuAttentionBackend
from kvtide.attention.torch_ref import TorchReferenceBackend

ISAS = cpu_extension.available_isas()
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
MIXED = [(1, 37), (1, 16), (1, 0), (7, 0), (5, 11), (1, 64), (19, 16), (3, 29), (40, 9)]
"""Decodes, short multi-token rows over cached context (kernel) and longer ones (SDPA)."""
LONG_DECODES = [(1, 300), (1, 129), (1, 1), (1, 255), (1, 64)]
SHORT_ROWS = [(4, 200), (2, 63), (8, 0), (3, 1), (16, 100)]
SINGLE = [(1, 0)] * 5
"""Every request's first token."""
CASES = [  # (requests, block_size, num_heads, num_kv_heads, head_dim, window): each dimension covered
    (MIXED, 16, 8, 8, 64, None),
    (MIXED, 32, 8, 4, 80, 7),
    (LONG_DECODES, 64, 8, 2, 96, None),
    (SHORT_ROWS, 128, 8, 1, 128, 33),
    (MIXED, 16, 4, 2, 256, None),
    (SINGLE, 16, 4, 1, 64, None),
    (LONG_DECODES + SHORT_ROWS, 16, 12, 4, 64, 100),
]
CASE_IDS = ["bs16-mha-d64", "bs32-gqa2-d80-win", "bs64-gqa4-d96", "bs128-gqa8-d128-win", "bs16-gqa2-d256",
            "single-token", "bench-heads-win"]


def to_head_major(ref_cache: torch.Tensor) -> torch.Tensor:
    """(2, num_blocks, block_size, H_kv, D) -> (2, H_kv, num_blocks, block_size, D)."""
    return ref_cache.permute(0, 3, 1, 2, 4).contiguous()


def kernel(isa: str):
    op = cpu_extension.load_paged_attention(isa)
    if op is None:
        pytest.fail(f"the {isa} build failed (see the warning logged)")
    return op


def backend_for(isa: str | None) -> CpuAttentionBackend:
    """The cpu backend on one ISA's build, or (None) on its pure-torch fallback."""
    backend = CpuAttentionBackend()
    backend._op = kernel(isa) if isa else None
    return backend


def reference(batch, scale: float, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's output, and the head-major cache after this step's K/V write."""
    cache = batch.kv_cache.clone()
    ref = TorchReferenceBackend()
    ref.write_kv(batch.key, batch.value, cache, batch.metadata.slot_mapping)
    return ref.forward(batch.query, cache, batch.metadata, scale, window), to_head_major(cache)


def run_backend(backend: CpuAttentionBackend, batch, scale: float, window: int | None) -> torch.Tensor:
    cache = to_head_major(batch.kv_cache)
    backend.write_kv(batch.key, batch.value, cache, batch.metadata.slot_mapping)
    return backend.forward(batch.query, cache, batch.metadata, scale, window, batch.key, batch.value)


@pytest.mark.parametrize("isa", ISAS + [None], ids=ISAS + ["pure-torch"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_backend_equals_reference(isa, case, monkeypatch):
    # Rows of up to 19 tokens through the kernel, the 40-token one through SDPA.
    monkeypatch.setattr(cpu_backend, "KERNEL_MAX_QUERY_LEN", 32)
    requests, block_size, num_heads, num_kv_heads, head_dim, window = case
    batch = make_paged_batch(requests, num_heads, num_kv_heads, head_dim, block_size, torch.float32,
                             seed=block_size + head_dim)
    expected, _ = reference(batch, head_dim ** -0.5, window)
    actual = run_backend(backend_for(isa), batch, head_dim ** -0.5, window)
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window", [None, 20])
def test_bfloat16_equals_reference(isa, window):
    batch = make_paged_batch(MIXED + LONG_DECODES, 8, 2, 64, 16, torch.bfloat16, seed=5)
    expected, _ = reference(batch, 0.125, window)
    actual = run_backend(backend_for(isa), batch, 0.125, window)
    torch.testing.assert_close(actual, expected, **TOL[torch.bfloat16])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("partition_tokens", [0, 16, 48, 1 << 20], ids=["auto", "16", "48", "whole"])
@pytest.mark.parametrize("window", [None, 40])
def test_contexts_split_in_partitions_merge_to_the_reference(isa, partition_tokens, window):
    """Partitions merged by log-sum-exp, whole rows, and rows some of whose partitions a query
    never sees (windows, causal multi-token rows) all give the reference's output."""
    batch = make_paged_batch([(1, 700), (1, 3), (5, 300), (1, 129)], 6, 2, 64, 16, torch.float32, seed=9)
    expected, cache = reference(batch, 0.125, window)
    md = batch.metadata
    out = torch.full_like(batch.query, float("nan"))
    kernel(isa)(out, batch.query, cache, md.block_tables, md.seq_lens, md.query_start_loc, md.num_reqs, 0.125,
                window or 0, partition_tokens)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


@pytest.mark.parametrize("isa", ISAS)
def test_all_rows_through_the_kernel_and_widely_spread_scores(isa, monkeypatch):
    """Every row, however long, through the kernel; queries scaled so scores spread far past the
    softmax cutoff (weights that must be exactly 0, not subnormal)."""
    monkeypatch.setattr(cpu_backend, "KERNEL_MAX_QUERY_LEN", 1 << 30)
    batch = make_paged_batch(MIXED, 8, 2, 32, 16, torch.float32, seed=2)
    batch.query *= 30
    expected, _ = reference(batch, 32 ** -0.5, None)
    actual = run_backend(backend_for(isa), batch, 32 ** -0.5, None)
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])


@pytest.mark.parametrize("isa", ISAS)
def test_zero_rows_and_strided_query(isa):
    op = kernel(isa)
    batch = make_paged_batch(MIXED, 8, 2, 32, 16, torch.float32, seed=4)
    expected, cache = reference(batch, 0.2, None)
    md = batch.metadata
    out = torch.zeros_like(batch.query)
    op(out, batch.query, cache, md.block_tables, md.seq_lens, md.query_start_loc, 0, 0.2, 0)
    assert torch.equal(out, torch.zeros_like(out))  # no rows: nothing written
    # The query as a view of a fused qkv tensor (strided tokens), as the model passes it.
    qkv = torch.cat([batch.query, torch.randn_like(batch.query)], dim=1)
    query = qkv[:, :8]
    decodes = md.num_decodes
    op(out, query, cache, md.block_tables, md.seq_lens, md.query_start_loc, decodes, 0.2, 0)
    torch.testing.assert_close(out[:decodes], expected[:decodes], **TOL[torch.float32])


def test_disabled_by_environment_falls_back_to_pure_torch(monkeypatch):
    monkeypatch.setenv("KVTIDE_CPU_KERNELS", "0")
    backend = CpuAttentionBackend()
    assert backend._op is None
    batch = make_paged_batch(MIXED, 8, 2, 32, 16, torch.float32, seed=1)
    expected, _ = reference(batch, 0.2, 5)
    torch.testing.assert_close(run_backend(backend, batch, 0.2, 5), expected, **TOL[torch.float32])


def test_failed_build_falls_back_with_a_warning(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("KVTIDE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_extension, "_loaded", {})
    monkeypatch.setattr(cpu_extension, "_warned", set())
    monkeypatch.setitem(cpu_extension.ISA_FLAGS, "default", ["-fno-such-flag-kvtide"])
    with caplog.at_level("WARNING"):
        assert cpu_extension.load_paged_attention("default") is None
        assert cpu_extension.load_paged_attention("default") is None
    assert sum("unavailable" in r.message for r in caplog.records) == 1


def test_best_isa_follows_the_cpu_capability(monkeypatch):
    assert ISAS[-1] == "default" and ISAS[0] in cpu_extension.ISA_FLAGS
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert cpu_extension.available_isas() == ["avx2", "default"]
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "SVE256")
    assert cpu_extension.available_isas() == ["default"]
    with pytest.raises(ValueError, match="isa must be one of"):
        cpu_extension.load_paged_attention("avx9000")


def _bad_inputs(batch, cache):
    md = batch.metadata
    q, out = batch.query, torch.empty_like(batch.query)
    args = dict(out=out, query=q, kv_cache=cache, block_tables=md.block_tables, seq_lens=md.seq_lens,
                query_start_loc=md.query_start_loc)
    bad_table = md.block_tables.clone()
    bad_table[0, 0] = cache.shape[2]
    short = md.seq_lens.clone()
    short[md.num_decodes] = 1  # a 7-token row over a context of 1
    return {
        "float64": {**args, "query": q.double(), "out": out.double(), "kv_cache": cache.double()},
        "float64 cache": {**args, "kv_cache": cache.double()},
        "out dtype": {**args, "out": out.bfloat16()},
        "int64 tables": {**args, "block_tables": md.block_tables.long()},
        "4-D cache": {**args, "kv_cache": cache[0]},
        "head_dim": {**args, "query": q[..., :16].contiguous(), "out": out[..., :16].contiguous()},
        "heads not a multiple": {**args, "query": q[:, :3].contiguous(), "out": out[:, :3].contiguous()},
        "out shape": {**args, "out": out[:-1]},
        "block id": {**args, "block_tables": bad_table},
        "seq_len < q_len": {**args, "seq_lens": short},
    }


@pytest.mark.parametrize("isa", ISAS[:1])
def test_bad_input_raises(isa):
    op = kernel(isa)
    batch = make_paged_batch(MIXED, 8, 2, 32, 16, torch.float32, seed=6)
    cache = to_head_major(batch.kv_cache)
    for name, a in _bad_inputs(batch, cache).items():
        with pytest.raises(RuntimeError, match="paged_attention"):
            op(a["out"], a["query"], a["kv_cache"], a["block_tables"], a["seq_lens"], a["query_start_loc"],
               batch.metadata.num_reqs, 0.1, 0)
            pytest.fail(f"{name} was accepted")


@pytest.mark.parametrize("engine", [
    dict(kv_cache_memory="8MiB", max_num_batched_tokens=16),  # prefill chunks mixed with decodes
    dict(kv_cache_memory=2 * 16 * 2 * 32 * 4 * 4 * 10, max_model_len=128),  # 10 blocks: preemption
], ids=["chunked", "preempting"])
def test_engine_greedy_tokens_equal_reference_backend(llama_dir, engine):
    from kvtide import LLM, SamplingParams

    prompts = [[5 + (7 * i + 3 * j) % 200 for j in range(4 + 9 * i)] for i in range(6)]

    def generate(backend: str):
        llm = LLM(llama_dir, attention_backend=backend, **{"max_model_len": 256, **engine})
        params = [SamplingParams(temperature=0, max_tokens=12 + 9 * i, ignore_eos=True, logprobs=2)
                  for i in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert llm.engine.core.executor.runner.attention_backend.name == backend
        if "max_num_batched_tokens" not in engine:
            assert llm.engine.core.scheduler.num_preemptions > 0
        return [o.outputs[0] for o in outs]

    expected, actual = generate("torch_ref"), generate("cpu")
    for e, a in zip(expected, actual, strict=True):
        assert a.token_ids == e.token_ids
        for token, le, la in zip(e.token_ids, e.logprobs, a.logprobs, strict=True):
            assert abs(la[token].logprob - le[token].logprob) < 1e-4
