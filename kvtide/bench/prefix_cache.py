"""Prefix-cache benchmark: the same workloads with the cache off and on, in one run.

    python -m kvtide.bench.prefix_cache                 # demo model (~1M parameters), a couple of minutes
    python -m kvtide.bench.prefix_cache --model bench   # the ~125M bench checkpoint (see bench/common.py)

Shared prefix: 64 requests, each one of 4 shared 1,024-token prefixes + a unique 64-token suffix,
32 output tokens (greedy, EOS ignored), all submitted at once. Reported per mode: prompt tokens
actually computed (prefill, recomputation after preemption included), prefix-cache hit rate (in
tokens), mean and p99 time to first token, and throughput.

Multi-turn: conversations of 8 turns whose prompt is the whole history so far (a system prompt,
then per turn a user message and the assistant's previous answer); per turn, the mean time to
first token with the cache off and on.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

from kvtide import LLM, SamplingParams
from kvtide.outputs import RequestOutput


@dataclass
class ModeResult:
    prefix_cache: bool
    prefill_tokens: int
    hit_rate: float
    mean_ttft_s: float
    p99_ttft_s: float
    wall_s: float
    output_tok_s: float
    total_tok_s: float
    preemptions: int


class PrefillCounter:
    """Counts prompt tokens computed per step by wrapping the executor (prefix hits are not
    scheduled, so they are not counted; recomputation after preemption is)."""

    def __init__(self, llm: LLM) -> None:
        self.tokens = 0
        core = llm.engine.core
        inner = core.executor.execute

        def execute(so):
            for req_id, n in so.num_scheduled_tokens.items():
                request = core.scheduler.requests[req_id]
                start = request.num_computed_tokens
                self.tokens += max(0, min(start + n, request.num_prompt_tokens) - start)
            return inner(so)

        core.executor.execute = execute


def ttft(output: RequestOutput) -> float:
    return output.metrics["first_token_time"] - output.metrics["arrival_time"]


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def make_llm(args, prefix_cache: bool) -> LLM:
    llm = LLM(args.model_dir, enable_prefix_caching=prefix_cache, max_model_len=args.max_model_len,
              kv_cache_memory=args.kv_cache_memory, seed=0)
    # Warm up (first-call overheads), then start from an empty cache and zeroed counters.
    llm.generate([[5] * 40], SamplingParams(max_tokens=2))
    llm.reset_prefix_cache()
    manager = llm.engine.core.scheduler.kv_cache_manager
    manager.prefix_stats = type(manager.prefix_stats)()
    return llm


# ---- shared-prefix workload ------------------------------------------------------------------

def shared_prefix_prompts(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(args.prefix_len)] for _ in range(args.num_prefixes)]
    prompts = [prefixes[i % args.num_prefixes] + [rng.randrange(3, vocab) for _ in range(args.suffix_len)]
               for i in range(args.num_requests)]
    rng.shuffle(prompts)
    return prompts


def run_shared_prefix(args, prompts: list[list[int]], prefix_cache: bool) -> ModeResult:
    llm = make_llm(args, prefix_cache)
    counter = PrefillCounter(llm)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    stats = llm.engine.core.get_stats()
    ttfts = [ttft(o) for o in outputs]
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_prompt = sum(len(p) for p in prompts)
    return ModeResult(
        prefix_cache=prefix_cache, prefill_tokens=counter.tokens,
        hit_rate=stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
        mean_ttft_s=statistics.fmean(ttfts), p99_ttft_s=p99(ttfts), wall_s=wall,
        output_tok_s=num_out / wall, total_tok_s=(num_out + num_prompt) / wall,
        preemptions=stats.num_preemptions)


# ---- multi-turn workload ---------------------------------------------------------------------

def run_multi_turn(args, vocab: int, prefix_cache: bool) -> tuple[list[float], list[int], list[list[int]]]:
    """Per turn: mean TTFT, prompt tokens computed, and the answers (to check both modes agree)."""
    rng = random.Random(args.seed + 1)
    system = [rng.randrange(3, vocab) for _ in range(args.system_len)]
    users = [[[rng.randrange(3, vocab) for _ in range(args.user_len)] for _ in range(args.turns)]
             for _ in range(args.conversations)]
    histories = [list(system) for _ in range(args.conversations)]
    llm = make_llm(args, prefix_cache)
    counter = PrefillCounter(llm)
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_len, ignore_eos=True)
    ttfts, prefill, answers = [], [], []
    for turn in range(args.turns):
        prompts = [h + users[c][turn] for c, h in enumerate(histories)]
        before = counter.tokens
        outputs = llm.generate(prompts, params)
        prefill.append(counter.tokens - before)
        ttfts.append(statistics.fmean(ttft(o) for o in outputs))
        for c, out in enumerate(outputs):
            answers.append(out.outputs[0].token_ids)
            histories[c] = prompts[c] + out.outputs[0].token_ids
    return ttfts, prefill, answers


# ---- reporting -------------------------------------------------------------------------------

def print_shared_prefix(off: ModeResult, on: ModeResult) -> None:
    print("\nShared prefix workload")
    print(f"{'':24}{'cache off':>12}{'cache on':>12}")
    rows = [("prefill tokens computed", off.prefill_tokens, on.prefill_tokens, "{:>12,}"),
            ("prefix hit rate", off.hit_rate, on.hit_rate, "{:>12.1%}"),
            ("mean TTFT (s)", off.mean_ttft_s, on.mean_ttft_s, "{:>12.3f}"),
            ("p99 TTFT (s)", off.p99_ttft_s, on.p99_ttft_s, "{:>12.3f}"),
            ("wall (s)", off.wall_s, on.wall_s, "{:>12.2f}"),
            ("output tok/s", off.output_tok_s, on.output_tok_s, "{:>12.1f}"),
            ("total tok/s", off.total_tok_s, on.total_tok_s, "{:>12.1f}"),
            ("preemptions", off.preemptions, on.preemptions, "{:>12}")]
    for name, a, b, fmt in rows:
        print(f"{name:24}" + fmt.format(a) + fmt.format(b))
    saved = 1 - on.prefill_tokens / max(off.prefill_tokens, 1)
    print(f"prefill tokens saved: {saved:.1%} (target >= 80%); mean TTFT speedup: "
          f"{off.mean_ttft_s / on.mean_ttft_s:.1f}x (target >= 3x)")


def print_multi_turn(off: tuple, on: tuple) -> None:
    print("\nMulti-turn workload (mean TTFT per turn, prompt tokens computed per turn)")
    print(f"{'turn':>4}{'TTFT off (s)':>14}{'TTFT on (s)':>13}{'speedup':>9}{'prefill off':>13}{'prefill on':>12}")
    for turn, (a, b, pa, pb) in enumerate(zip(off[0], on[0], off[1], on[1], strict=True), start=1):
        print(f"{turn:>4}{a:>14.3f}{b:>13.3f}{a / b:>8.1f}x{pa:>13,}{pb:>12,}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvtide.bench.prefix_cache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo",
                        help="'demo' (default, tiny), 'bench' (the ~125M bench checkpoint) or a directory")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=256)
    parser.add_argument("--user-len", type=int, default=64)
    parser.add_argument("--answer-len", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default=None, help="e.g. 2GiB (default: the engine's)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-multi-turn", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.model == "bench":
        from kvtide.bench.common import bench_model_path

        args.model_dir = bench_model_path()
    else:
        from kvtide.bench.common import resolve_model

        args.model_dir = resolve_model(args.model)
    with open(f"{args.model_dir}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    print(f"model {args.model_dir} (vocab {vocab}); {args.num_requests} requests = one of "
          f"{args.num_prefixes} x {args.prefix_len}-token prefixes + {args.suffix_len} unique tokens, "
          f"{args.output_len} output tokens")
    prompts = shared_prefix_prompts(args, vocab)
    off = run_shared_prefix(args, prompts, prefix_cache=False)
    on = run_shared_prefix(args, prompts, prefix_cache=True)
    print_shared_prefix(off, on)
    results: dict = {"shared_prefix": {"off": asdict(off), "on": asdict(on)}}
    if not args.skip_multi_turn:
        turns_off = run_multi_turn(args, vocab, prefix_cache=False)
        turns_on = run_multi_turn(args, vocab, prefix_cache=True)
        print_multi_turn(turns_off, turns_on)
        if turns_off[2] != turns_on[2]:
            print("warning: answers differ between cache off and on")
        results["multi_turn"] = {"ttft_off_s": turns_off[0], "ttft_on_s": turns_on[0],
                                 "prefill_off": turns_off[1], "prefill_on": turns_on[1],
                                 "answers_equal": turns_off[2] == turns_on[2]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
