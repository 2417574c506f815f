"""`kvtide bench throughput` (also `python -m kvtide.bench.throughput`): offline throughput.

Default workload (W1): 64 requests x 128 prompt tokens x 128 output tokens, greedy, EOS
ignored, on the bench checkpoint (random Llama, ~125M parameters, float32). In one run it measures

  1. this machine's float32 matmul peak (torch.mm at 2048^3, best of --matmul-reps, before and after
     the engines, the higher kept),
  2. kvtide: LLM.generate over all requests at once (continuous batching),
  3. HF transformers: generate in static batches of --hf-batch-size with left padding (unless --skip-hf),

and reports output tokens/s for each, the ratio, the achieved matmul GFLOP/s (see
kvtide.bench.common.workload_flops) as a fraction of the peak, and whether the greedy tokens agree.

--output-json also carries, at its top level, the keys `vllm bench throughput --output-json` writes,
for kvtide's run: elapsed_time (s), num_requests, total_num_tokens (prompt + output),
requests_per_second and tokens_per_second (total tokens / elapsed_time).

With --speculative-config, the speculative-decoding figures of the timed run follow
(kvtide.bench.spec_figures), and result["kvtide"]["spec_decode"] carries them in --output-json.
"""

from __future__ import annotations

import argparse
import gc
import sys
from dataclasses import fields

from kvtide.bench.common import (
    format_machine,
    greedy_agreement,
    machine_record,
    measure_matmul_peak,
    module_main,
    print_and_save,
    random_token_prompts,
    read_config,
    resolve_model,
    workload_flops,
)
from kvtide.bench.engines import HFAdapter, KvtideAdapter, format_expert_load, run_throughput
from kvtide.bench.spec_figures import format_spec_decode, speculative_config_record
from kvtide.engine_args import EngineArgs


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint directory or 'demo' (default: the bench checkpoint, built once)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths uniform in [len*(1-r), len*(1+r)]")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts (and the engine)")
    parser.add_argument("--output-json", default=None, help="write the result here")
    parser.add_argument("--skip-hf", action="store_true", help="do not run the HF transformers baseline")
    parser.add_argument("--hf-batch-size", type=int, default=None, help="HF static batch (default: all requests)")
    parser.add_argument("--matmul-reps", type=int, default=5, help="torch.mm repetitions for the peak")
    parser.add_argument("--skip-peak", action="store_true", help="do not measure the matmul peak")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed run, run kvtide again under torch.profiler and print where "
                             "the time goes (top ops by self CPU time)")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="run one short request through each engine first (not timed)")
    group = parser.add_argument_group("engine (kvtide)")
    EngineArgs.add_cli_args(group, skip=("model", "seed"))


def engine_kwargs_from_args(args) -> dict:
    """EngineArgs fields given on the command line (None values left to kvtide's defaults)."""
    kwargs = {f.name: getattr(args, f.name) for f in fields(EngineArgs)
              if f.name not in ("model",) and hasattr(args, f.name) and getattr(args, f.name) is not None}
    kwargs["seed"] = args.seed
    return kwargs


def _measure(adapter, prompts, output_lens, warmup: bool) -> dict:
    if warmup:
        adapter.generate([prompts[0][:8]], [2])
    return run_throughput(adapter, {"prompts": prompts, "output_lens": output_lens})


def vllm_throughput_keys(measured: dict) -> dict:
    """The figures of one engine's run (run_throughput's dict) under the keys vLLM's
    `vllm bench throughput --output-json` uses, so tools that read vLLM's file read this one."""
    elapsed = measured["elapsed_s"]
    num_requests = measured["num_requests"]
    total_tokens = measured["prompt_tokens"] + measured["output_tokens"]
    return {"elapsed_time": elapsed, "num_requests": num_requests, "total_num_tokens": total_tokens,
            "requests_per_second": num_requests / elapsed, "tokens_per_second": total_tokens / elapsed}


def _add_flops(result: dict, flops: float, peak: float | None) -> None:
    result["gflop_per_s"] = flops / result["elapsed_s"] / 1e9
    if peak:
        result["fraction_of_peak"] = result["gflop_per_s"] / peak


def run(args) -> dict:
    import torch

    model_dir = resolve_model(args.model)
    config = read_config(model_dir)
    prompts, output_lens = random_token_prompts(config["vocab_size"], args.num_prompts, args.input_len,
                                                args.output_len, args.seed, args.random_range_ratio)
    flops = workload_flops(config, [len(p) for p in prompts], output_lens)
    result: dict = {
        "model": model_dir, "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "random_range_ratio": args.random_range_ratio, "seed": args.seed,
        "torch_threads": torch.get_num_threads(), "workload_tflop": flops / 1e12,
        "speculative_config": speculative_config_record(getattr(args, "speculative_config", None)),
    }
    peak_before = None if args.skip_peak else measure_matmul_peak(reps=args.matmul_reps)

    kvtide = KvtideAdapter({"model": model_dir, "max_model_len": None, "engine_kwargs": engine_kwargs_from_args(args)})
    result["kvtide"] = _measure(kvtide, prompts, output_lens, args.warmup)
    result["machine"] = machine_record()  # after kvtide loaded: with its GEMM choices
    kvtide_tokens = result["kvtide"].pop("token_ids")
    result.update(vllm_throughput_keys(result["kvtide"]))
    if args.profile:
        result["kvtide_profile"] = profile_generate(kvtide, prompts, output_lens)
    del kvtide
    gc.collect()

    if not args.skip_hf:
        hf = HFAdapter({"model": model_dir, "hf_batch_size": args.hf_batch_size})
        result["hf"] = _measure(hf, prompts, output_lens, args.warmup)
        result["hf"]["batch_size"] = args.hf_batch_size or args.num_prompts
        result["hf"]["version"] = hf.version
        hf_tokens = result["hf"].pop("token_ids")
        result["kvtide_over_hf"] = result["kvtide"]["output_tok_s"] / result["hf"]["output_tok_s"]
        result["greedy_agreement_with_hf"] = greedy_agreement(kvtide_tokens, hf_tokens)
        del hf
        gc.collect()
    # The peak is measured before and after the engines; the higher counts, so a busy moment at
    # either end does not lower the ceiling.
    peak = None if args.skip_peak else max(peak_before, measure_matmul_peak(reps=args.matmul_reps))
    result["matmul_peak_gflop_per_s"] = peak
    if peak:  # what the workload would reach at the matmul peak
        result["output_tok_s_at_peak"] = sum(output_lens) / (flops / (peak * 1e9))
    for engine in ("kvtide", "hf"):
        if engine in result:
            _add_flops(result[engine], flops, peak)
    return result


def profile_generate(adapter, prompts: list[list[int]], output_lens: list[int], top: int = 25) -> dict:
    """Top ops by self CPU time over one more generate() (not timed: the profiler slows it down),
    and how much of the wall time torch ops account for (the rest: Python, scheduling, sampling glue)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    # The timed run left these prompts' blocks in the prefix cache: without a reset, the profiled
    # run would skip their prefill and show a decode-only step.
    adapter.llm.reset_prefix_cache()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        adapter.generate(prompts, output_lens)
        wall_ms = (time.perf_counter() - start) * 1000
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    return {"wall_ms": wall_ms, "ops_ms": total / 1000,
            "top": [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1000,
                     "fraction": e.self_cpu_time_total / total} for e in events[:top]]}


def format_result(result: dict) -> str:
    lines = [format_machine(result["machine"])] if "machine" in result else []
    lines += [f"workload: {result['num_prompts']} requests x {result['input_len']} prompt tokens x "
             f"{result['output_len']} output tokens (greedy, EOS ignored); {result['workload_tflop']:.2f} TFLOP "
             f"of matmuls; torch threads {result['torch_threads']}"]
    peak = result.get("matmul_peak_gflop_per_s")
    if peak:
        lines.append(f"matmul peak (torch.mm 2048^3 float32): {peak:.1f} GFLOP/s -> ceiling "
                     f"{result['output_tok_s_at_peak']:.1f} output tok/s")
    for key, label in (("kvtide", "kvtide"), ("hf", "HF transformers")):
        r = result.get(key)
        if not r:
            continue
        extra = f" (static batch {r['batch_size']})" if key == "hf" else ""
        frac = f", {r['fraction_of_peak']:.0%} of peak" if "fraction_of_peak" in r else ""
        lines.append(f"{label}{extra}: {r['elapsed_s']:.2f} s, {r['requests_per_s']:.2f} req/s, "
                     f"{r['total_tok_s']:.1f} total tok/s, {r['output_tok_s']:.1f} output tok/s, "
                     f"{r['gflop_per_s']:.1f} GFLOP/s{frac}")
        if r.get("spec_decode"):
            lines.append(format_spec_decode(r["spec_decode"], f"{label} speculative decoding"))
        if r.get("expert_load"):
            lines.append(format_expert_load(r["expert_load"], label))
    if "kvtide_over_hf" in result:
        agree = result["greedy_agreement_with_hf"]
        lines.append(f"kvtide / HF output tok/s: {result['kvtide_over_hf']:.2f}x; greedy tokens identical "
                     f"for {agree['identical']}/{agree['of']} requests")
    if result.get("kvtide_profile"):
        prof = result["kvtide_profile"]
        lines.append(f"kvtide profile (one more run under torch.profiler): torch ops {prof['ops_ms']:.0f} ms of "
                     f"{prof['wall_ms']:.0f} ms wall; top ops by self CPU time:")
        for row in prof["top"]:
            lines.append(f"  {row['fraction']:6.1%} {row['self_cpu_ms']:10.1f} ms {row['calls']:7d} calls  {row['op']}")
    return "\n".join(lines)


def main_throughput(args) -> int:
    result = run(args)
    return print_and_save(result, format_result(result), args.output_json)


def main(argv: list[str] | None = None) -> int:
    return module_main(argv, "throughput", __doc__, add_throughput_args, main_throughput)


if __name__ == "__main__":
    sys.exit(main())
