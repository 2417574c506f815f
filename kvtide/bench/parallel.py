"""`kvtide bench parallel`: what tensor, pipeline and expert parallelism cost on this machine.

On a CPU with a few cores parallelism cannot make a model faster; what it costs is what matters at
scale. For each layout (`tp2`, `pp2`, `tp2pp2`, `tp2ep` for MoE models, `tp1` the baseline) one
replica is started and one offline workload run, and the table gives:

  startup   seconds from LLM(...) to ready (worker processes, process group, each rank's shard)
  out tok/s the workload's output throughput (all ranks share this machine's cores)
  per step  for rank 0 and each collective kind: calls, bytes sent, milliseconds inside the call
  model     the bytes the communication model predicts for rank 0 over the run (dense models):
              TP all-reduce: (2 x layers of its stage + 1 embedding) x tokens x hidden x 4 x 2(n-1)/n
              PP send:       2 (hidden states, residual) x tokens x hidden x 4 per stage boundary
            (tokens: every prompt and output token computed once; prefix caching is off)

    kvtide bench parallel --layouts tp1,tp2,pp2,tp2pp2 --num-prompts 8 --input-len 128 --output-len 32

Every figure is printed next to the machine (CPU model, ISA, threads).
"""

from __future__ import annotations

import argparse
import re
import time

from kvtide.bench.common import (
    align_rows,
    module_main,
    print_and_save,
    random_token_prompts,
    read_config,
    resolve_model,
)
from kvtide.machine import describe_machine, machine_info

_LAYOUT = re.compile(r"^(?:tp(?P<tp>\d+))?(?:pp(?P<pp>\d+))?(?P<ep>ep)?$")


def parse_layout(text: str) -> dict:
    """'tp2pp2' -> {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}; 'tp2ep' adds expert parallelism."""
    match = _LAYOUT.match(text)
    if not text or match is None:
        raise ValueError(f"layout {text!r}: expected tpN, ppN, tpNppM or tpNep (e.g. tp2pp2)")
    layout = {"tensor_parallel_size": int(match["tp"] or 1), "pipeline_parallel_size": int(match["pp"] or 1)}
    if match["ep"]:
        layout["enable_expert_parallel"] = True
    return layout


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint directory, 'bench-mixtral', or none: the ~110M bench shape")
    parser.add_argument("--layouts", default="tp1,tp2,pp2,tp2pp2", help="comma-separated layouts")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--cpu-threads-per-rank", type=int, default=None,
                        help="default: the usable cores split evenly, at least 1")
    parser.add_argument("--output-json", default=None)


def predicted_rank0_bytes(config: dict, layout: dict, tokens: int) -> dict[str, int]:
    from kvtide.distributed import split_evenly

    tp, pp = layout["tensor_parallel_size"], layout["pipeline_parallel_size"]
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    predicted = {}
    if tp > 1 and not layout.get("enable_expert_parallel"):  # (EP: MoE layers exchange by all-to-all instead)
        _, stage_layers = split_evenly(layers, pp, 0)
        predicted["tp.all_reduce"] = (2 * stage_layers + 1) * tokens * hidden * 4 * 2 * (tp - 1) // tp
    if pp > 1:
        predicted["pp.send"] = 2 * tokens * hidden * 4
    return predicted


def run_layout(model_dir: str, config: dict, name: str, args: argparse.Namespace) -> dict:
    from kvtide import LLM, SamplingParams
    from kvtide.distributed.config_checks import usable_cpus

    layout = parse_layout(name)
    world = layout["tensor_parallel_size"] * layout["pipeline_parallel_size"]
    threads = args.cpu_threads_per_rank or max(1, usable_cpus() // world)
    prompts, _ = random_token_prompts(config["vocab_size"], args.num_prompts, args.input_len, args.output_len, seed=0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    llm = LLM(model_dir, enable_prefix_caching=False, max_model_len=args.input_len + args.output_len + 16,
              kv_cache_memory="256MiB", cpu_threads_per_rank=threads if world > 1 else None, **layout)
    startup = time.perf_counter() - start
    try:
        # warm-up: the same prompts through prefill and a few decode steps (first-use costs: kernel
        # loads, per-shape GEMM choices), so no layout pays them inside the timed run
        llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=4))
        executor = llm.engine.core.executor
        before = executor.comm_stats() if hasattr(executor, "comm_stats") else {}
        steps_before = llm.engine.core.num_steps
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        elapsed = time.perf_counter() - start
        steps = llm.engine.core.num_steps - steps_before
        after = executor.comm_stats() if hasattr(executor, "comm_stats") else {}
    finally:
        llm.shutdown()
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    tokens = sum(len(p) for p in prompts) + output_tokens - len(prompts)
    per_kind = {}
    for kind, figures in after.get(0, {}).items():
        was = before.get(0, {}).get(kind, {})
        delta = {field: figures[field] - was.get(field, 0) for field in ("calls", "bytes", "seconds")}
        if delta["calls"]:  # this process keeps counting across layouts: only this run's kinds
            per_kind[kind] = delta
    return {"layout": name, "world_size": world, "threads_per_rank": threads, "startup_s": startup,
            "output_tokens_per_s": output_tokens / elapsed, "steps": steps, "tokens_computed": tokens,
            "rank0": per_kind, "predicted_rank0_bytes": predicted_rank0_bytes(config, layout, tokens)}


def main_parallel(args: argparse.Namespace) -> int:
    model_dir = resolve_model(args.model)
    config = read_config(model_dir)
    results = [run_layout(model_dir, config, name.strip(), args) for name in args.layouts.split(",") if name.strip()]
    rows = [("layout", "ranks", "startup s", "out tok/s", "steps", "collective (rank 0)", "calls/step", "KiB/step",
             "ms/step", "model KiB/step")]
    for r in results:
        kinds = sorted(r["rank0"]) or ["-"]
        for i, kind in enumerate(kinds):
            head = (r["layout"], str(r["world_size"]), f"{r['startup_s']:.1f}", f"{r['output_tokens_per_s']:.1f}",
                    str(r["steps"])) if i == 0 else ("", "", "", "", "")
            figures = r["rank0"].get(kind)
            if figures is None:
                rows.append(head + ("-", "", "", "", ""))
                continue
            steps = max(r["steps"], 1)
            model = r["predicted_rank0_bytes"].get(kind)
            rows.append(head + (kind, f"{figures['calls'] / steps:.1f}", f"{figures['bytes'] / steps / 1024:.1f}",
                                f"{figures['seconds'] / steps * 1e3:.2f}",
                                f"{model / steps / 1024:.1f}" if model is not None else ""))
    text = "\n".join([f"kvtide bench parallel  ({describe_machine()})",
                      f"model {model_dir}: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}; "
                      f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, float32", ""]
                     + align_rows(rows))
    return print_and_save({"machine": machine_info(), "model": model_dir, "results": results}, text, args.output_json)


def main(argv: list[str] | None = None) -> int:
    return module_main(argv, "parallel", __doc__, add_parallel_args, main_parallel)


if __name__ == "__main__":
    raise SystemExit(main())
