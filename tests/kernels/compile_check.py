"""Compile kvtide's Triton kernels to cubin for NVIDIA targets without a GPU (Triton ships ptxas):
catches what the interpreter cannot, e.g. tl.dot shape rules, layouts, shared memory per block.

    python tests/kernels/compile_check.py [--all]    # run by test_triton_compile.py in a clean process

Prints one line per kernel configuration and exits 1 if any fails or needs more shared memory than
the target has. Must run without TRITON_INTERPRET (it needs compiled-mode JITFunctions).
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kvtide.attention.triton_kernels as attention_kernels
import kvtide.layers.moe.triton_moe as moe_kernels
import kvtide.layers.triton_ops as ops

SHARED_MEMORY_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def _attention(dtype: torch.dtype, qpk: int, max_query_len: int, head_dim: int, window: bool,
               kinds: tuple[int, int] = (-1, -1), soft_cap: bool = False, sinks: bool = False):
    """kinds: (K, V) kind ids of formats.KIND_IDS, -1 for a float cache."""
    ptr = POINTER[dtype]
    tiling = attention_kernels.attention_tiling(qpk, max_query_len, head_dim, dtype)
    options = {"num_warps": tiling.pop("num_warps"), "num_stages": tiling.pop("num_stages")}
    fp8 = kinds[0] in (0, 1)
    signature = {
        "out_ptr": ptr, "query_ptr": ptr, "cache_ptr": ptr if kinds[0] < 0 else "*u8",
        "kv_scale_ptr": "*fp32" if fp8 else "constexpr", "sink_logits_ptr": "*fp32" if sinks else "constexpr",
        "block_tables_ptr": "*i32",
        "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "scale_log2": "fp32", "num_reqs": "i32",
        "head_dim": "i32", "window": "i32", "sink_tokens": "i32", "soft_cap_log2": "fp32",
        "two_over_soft_cap": "fp32", "query_stride_t": "i32",
        "query_stride_h": "i32", "out_stride_t": "i32", "out_stride_h": "i32", "cache_stride_block": "i32",
        "cache_stride_h": "i32", "k_slot_stride": "i32", "v_offset": "i64", "v_slot_stride": "i32",
        "k_params_offset": "i32", "v_params_offset": "i32", "block_table_stride": "i32"}
    block_v = max(16, triton.next_power_of_2(head_dim // 2)) if kinds[1] == 3 else tiling["BLOCK_D"]
    constexprs = dict(K_KIND=kinds[0], V_KIND=kinds[1], BLOCK_V=block_v, QUERIES_PER_KV=qpk, KV_BLOCK_SIZE=16,
                      USE_WINDOW=window, USE_SOFT_CAP=soft_cap, USE_SINK_LOGITS=sinks,
                      DOT_PRECISION="ieee" if dtype == torch.float32 else None, **tiling)
    if not fp8:
        constexprs["kv_scale_ptr"] = None
    if not sinks:
        constexprs["sink_logits_ptr"] = None
    label = (f"attention {ptr} kinds={kinds} qpk={qpk} max_query_len={max_query_len} head_dim={head_dim} "
             f"window={window} soft_cap={soft_cap} sinks={sinks}")
    return label, attention_kernels._paged_attention_kernel, signature, constexprs, options


def _write_kv_quant(kinds: tuple[int, int]):
    return (f"write_kv_quant kinds={kinds}", attention_kernels._write_kv_quant_kernel,
            {"key_ptr": "*bf16", "value_ptr": "*bf16", "cache_ptr": "*u8", "slot_mapping_ptr": "*i64",
             "kv_scale_ptr": "*fp32", "key_stride_t": "i32", "key_stride_h": "i32", "value_stride_t": "i32",
             "value_stride_h": "i32", "cache_stride_h": "i64", "cache_stride_block": "i32",
             "v_codes_offset": "i32", "k_params_offset": "i32", "v_params_offset": "i32", "num_kv_heads": "i32",
             "head_dim": "i32", "block_size": "i32"},
            {"K_KIND": kinds[0], "V_KIND": kinds[1], "BLOCK_H": 8, "BLOCK_D": 128}, {})


def _elementwise(dtype: torch.dtype):
    ptr = POINTER[dtype]
    yield (f"write_kv {ptr}", attention_kernels._write_kv_kernel,
           {"key_ptr": ptr, "value_ptr": ptr, "cache_ptr": ptr, "slot_mapping_ptr": "*i64",
            "key_stride_t": "i32", "key_stride_h": "i32", "value_stride_t": "i32", "value_stride_h": "i32",
            "cache_stride_kv": "i64", "cache_stride_block": "i32", "cache_stride_slot": "i32",
            "cache_stride_h": "i32", "num_kv_heads": "i32", "head_dim": "i32", "block_size": "i32"},
           {"BLOCK_H": 8, "BLOCK_D": 128}, {})
    for residual in (True, False):
        yield (f"rms_norm {ptr} residual={residual}", ops._rms_norm_kernel,
               {"x_ptr": ptr, "residual_ptr": ptr, "weight_ptr": ptr, "out_ptr": ptr, "hidden_size": "i32",
                "eps": "fp32"}, {"HAS_RESIDUAL": residual, "BLOCK": 4096}, {"num_warps": 8})
    yield (f"rotary {ptr}", ops._rotary_kernel,
           {"q_ptr": ptr, "k_ptr": ptr, "cos_ptr": ptr, "sin_ptr": ptr, "q_stride_t": "i32", "q_stride_h": "i32",
            "k_stride_t": "i32", "k_stride_h": "i32", "cos_stride_t": "i32", "sin_stride_t": "i32",
            "num_q_heads": "i32", "num_kv_heads": "i32", "half": "i32"},
           {"BLOCK_HQ": 32, "BLOCK_HK": 8, "BLOCK_HALF": 64}, {})
    yield (f"silu_and_mul {ptr}", ops._silu_and_mul_kernel, {"x_ptr": ptr, "out_ptr": ptr, "d": "i32"},
           {"BLOCK": 1024}, {})


def _moe_gemm(dtype: torch.dtype, mul_weight: bool, rows_per_expert: int):
    ptr = POINTER[dtype]
    signature = {"a_ptr": ptr, "w_ptr": ptr, "c_ptr": ptr, "topk_weights_ptr": "*fp32", "sorted_ids_ptr": "*i32",
                 "block_expert_ptr": "*i32", "N": "i32", "K": "i32", "num_assignments": "i32",
                 "num_experts": "i32", "a_row_divisor": "i32", "a_stride_m": "i32", "a_stride_k": "i32",
                 "w_stride_e": "i32", "w_stride_n": "i32", "w_stride_k": "i32", "c_stride_m": "i32",
                 "c_stride_n": "i32"}
    tiling = moe_kernels.moe_tiling(rows_per_expert, 1)  # decode (BLOCK_M 16) or prefill (64) tiles
    options = {"num_warps": tiling.pop("num_warps"), "num_stages": tiling.pop("num_stages")}
    constexprs = dict(MUL_WEIGHT=mul_weight, DOT_PRECISION="ieee" if dtype == torch.float32 else None, **tiling)
    return (f"moe grouped_gemm {ptr} mul_weight={mul_weight} BLOCK_M={tiling['BLOCK_M']}",
            moe_kernels._grouped_gemm_kernel, signature, constexprs, options)


def configurations(everything: bool):
    dtypes = list(POINTER) if everything else [torch.bfloat16]
    shapes = [(4, 1, 128, False), (4, 64, 128, False), (1, 1, 64, True), (8, 64, 128, True), (32, 1, 128, False),
              (1, 64, 256, False)]
    for dtype in dtypes:
        for shape in shapes if everything else shapes[:4]:
            yield _attention(dtype, *shape)
        yield from _elementwise(dtype)
        yield _moe_gemm(dtype, False, 16)
        yield _moe_gemm(dtype, True, 128)
    # quantized caches (fp8_e4m3, fp8_e5m2, int8, k8v4): a bf16 decode and a float32 prefill each
    for kinds in ((0, 0), (1, 1), (2, 2), (2, 3)):
        yield _attention(torch.bfloat16, 4, 1, 128, False, kinds)
        yield _attention(torch.float32, 8, 64, 128, True, kinds)
        yield _write_kv_quant(kinds)
    # attention logit soft-capping (Gemma 2): a bf16 decode and a bf16 windowed prefill
    yield _attention(torch.bfloat16, 2, 1, 256, False, soft_cap=True)
    yield _attention(torch.bfloat16, 2, 64, 256, True, soft_cap=True)
    # attention sink logits (gpt-oss: head_dim 64, 8 queries per KV head, windowed and full layers)
    yield _attention(torch.bfloat16, 8, 1, 64, True, sinks=True)
    yield _attention(torch.bfloat16, 8, 64, 64, False, sinks=True)
    if not everything:  # float32 prefill: the most shared memory
        yield _attention(torch.float32, 8, 64, 128, True)
        yield _attention(torch.float32, 1, 64, 256, False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--all", action="store_true", help="every dtype and shape on sm_80 and sm_90")
    args = parser.parse_args(argv)
    failures = 0
    for capability in (90, 80) if args.all else (90,):
        target = GPUTarget("cuda", capability, 32)
        for label, fn, signature, constexprs, options in configurations(args.all):
            signature = dict(signature, **{name: "constexpr" for name in constexprs})
            try:
                kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                        target=target, options=options)
                shared = kernel.metadata.shared
                ok = shared <= SHARED_MEMORY_LIMIT[capability]
                print(f"{'OK  ' if ok else 'FAIL'} sm_{capability} {label}: {shared} B shared")
            except Exception as e:  # report every configuration, then fail
                ok = False
                print(f"FAIL sm_{capability} {label}: {type(e).__name__}: {str(e)[:600]}")
            failures += not ok
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
