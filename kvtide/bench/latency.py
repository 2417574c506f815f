"""`kvtide bench latency`: one request at a time, offline: TTFT, TPOT and tokens/s.

Default workload (PEERS.md's W2): a 128-token prompt, 256 output tokens, greedy, EOS ignored, on the
bench checkpoint. Each iteration uses a fresh random prompt, so no prefix-cache hit shortens the
prefill; --num-iters-warmup iterations run first and are not counted. Reported as medians:

  TTFT    request added -> first output token
  TPOT    (E2E - TTFT) / (output_len - 1); decode tokens/s is its inverse
  E2E     request added -> last output token; tokens/s = output_len / E2E

With --speculative-config, the speculative-decoding figures of the measured iterations follow
(kvtide.bench.spec_figures), and result["kvtide"]["spec_decode"] carries them in --output-json.
"""

from __future__ import annotations

import argparse
import sys

from kvtide.bench.common import (
    format_machine,
    machine_record,
    module_main,
    print_and_save,
    random_token_prompts,
    read_config,
    resolve_model,
)
from kvtide.bench.engines import HFAdapter, KvtideAdapter, run_latency
from kvtide.bench.spec_figures import format_spec_decode, speculative_config_record
from kvtide.bench.throughput import engine_kwargs_from_args
from kvtide.engine_args import EngineArgs


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint directory or 'demo' (default: the bench checkpoint, built once)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-iters", type=int, default=5, help="measured iterations")
    parser.add_argument("--num-iters-warmup", type=int, default=1, help="unmeasured iterations first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf", action="store_true", help="also measure HF transformers generate")
    parser.add_argument("--dataset", default="random", choices=("random", "grounded"),
                        help="random tokens of --input-len, or chat requests that copy their input "
                             "(bench/datasets.py grounded_conversations)")
    parser.add_argument("--output-json", default=None)
    group = parser.add_argument_group("engine (kvtide)")
    EngineArgs.add_cli_args(group, skip=("model", "seed"))


def latency_workload(vocab_size: int, args, model_dir: str | None = None) -> dict:
    """2 prompts per iteration: the second is for engines that time TTFT with a separate request."""
    if args.num_iters < 1 or args.num_iters_warmup < 0:
        raise ValueError("--num-iters must be >= 1 and --num-iters-warmup >= 0")
    count = 2 * (args.num_iters + args.num_iters_warmup)
    if getattr(args, "dataset", "random") == "grounded":
        from kvtide.bench.datasets import grounded_dataset, load_tokenizer_for_bench

        prompts = [job.prompt_token_ids for job in grounded_dataset(load_tokenizer_for_bench(None, model_dir), count, 1)]
        return {"prompts": prompts, "output_len": args.output_len, "num_warmup": args.num_iters_warmup}
    prompts, _ = random_token_prompts(vocab_size, count, args.input_len, 1, args.seed)
    return {"prompts": prompts, "output_len": args.output_len, "num_warmup": args.num_iters_warmup}


def run(args) -> dict:
    model_dir = resolve_model(args.model)
    workload = latency_workload(read_config(model_dir)["vocab_size"], args, model_dir)
    result: dict = {"model": model_dir, "input_len": args.input_len, "output_len": args.output_len,
                    "num_iters": args.num_iters, "num_iters_warmup": args.num_iters_warmup, "seed": args.seed,
                    "speculative_config": speculative_config_record(getattr(args, "speculative_config", None))}
    kvtide = KvtideAdapter({"model": model_dir, "max_model_len": None, "engine_kwargs": engine_kwargs_from_args(args)})
    result["kvtide"] = run_latency(kvtide, workload)
    result["machine"] = machine_record()  # after kvtide loaded: with its GEMM choices
    del kvtide
    if args.hf:
        hf = HFAdapter({"model": model_dir})
        result["hf"] = run_latency(hf, workload)
        result["hf"]["version"] = hf.version
    return result


def format_result(result: dict) -> str:
    lines = [format_machine(result["machine"])] if "machine" in result else []
    lines += [f"one request: {result['input_len']} prompt tokens, {result['output_len']} output tokens; "
             f"median of {result['num_iters']} iterations"]
    for key, label in (("kvtide", "kvtide"), ("hf", "HF transformers")):
        r = result.get(key)
        if not r:
            continue
        tpot = f", TPOT {r['tpot_ms']:.2f} ms ({r['decode_tokens_per_s']:.1f} decode tok/s)" if "tpot_ms" in r else ""
        lines.append(f"{label}: TTFT {r['ttft_ms']:.1f} ms{tpot}, E2E {r['e2e_ms']:.1f} ms, "
                     f"{r['tokens_per_s']:.1f} tok/s")
        if r.get("spec_decode"):
            lines.append(format_spec_decode(r["spec_decode"], f"{label} speculative decoding"))
    return "\n".join(lines)


def main_latency(args) -> int:
    result = run(args)
    return print_and_save(result, format_result(result), args.output_json)


def main(argv: list[str] | None = None) -> int:
    return module_main(argv, "latency", __doc__, add_latency_args, main_latency)


if __name__ == "__main__":
    sys.exit(main())
