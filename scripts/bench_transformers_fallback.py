"""W1-style batch throughput of one checkpoint through kvtide's own Llama and through the
transformers fallback (--model-impl transformers): how much the fallback's HF modules cost.

N random-token prompts of L tokens, all submitted at once, greedy, EOS ignored, prefix caching off;
both engines loaded side by side once, their runs interleaved (order alternating). Prints each
run's output tokens/s, each engine's median, the fallback's ratio to native, and the machine line.

    python scripts/bench_transformers_fallback.py                       # W1: 64 x 128 -> 128, bench Llama
    python scripts/bench_transformers_fallback.py --num-prompts 32 --output-len 64 --repeats 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvtide import LLM, SamplingParams
from kvtide.bench.common import resolve_model
from kvtide.machine import describe_machine

IMPLS = ("kvtide", "transformers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bench Llama, h768 l12)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs per engine; the median counts")
    args = parser.parse_args()
    model = resolve_model(args.model)
    engines = {impl: LLM(model=model, device="cpu", dtype="float32", max_model_len=1024, kv_cache_memory="1GiB",
                         enable_prefix_caching=False, model_impl=impl) for impl in IMPLS}
    vocab = engines["kvtide"].get_tokenizer().vocab_size
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for llm in engines.values():  # warm-up: kernels built, GEMM verdicts measured
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    rates: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    tokens: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        for impl in IMPLS if repeat % 2 == 0 else reversed(IMPLS):
            start = time.perf_counter()
            outputs = engines[impl].generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            rates[impl].append(args.num_prompts * args.output_len / elapsed)
            tokens[impl] = [out.outputs[0].token_ids for out in outputs]
            print(f"run {repeat + 1} {impl:>12}: {elapsed:7.2f} s, {rates[impl][-1]:7.1f} output tok/s", flush=True)
    print(describe_machine())
    print(f"workload: {args.num_prompts} requests x {args.input_len} prompt tokens x {args.output_len} output "
          f"tokens (greedy, EOS ignored), {model}")
    native, fallback = (statistics.median(rates[impl]) for impl in IMPLS)
    same = sum(a == b for a, b in zip(tokens["kvtide"], tokens["transformers"], strict=True))
    print(f"output tok/s (median of {args.repeats}): native {native:.1f}, transformers fallback {fallback:.1f} "
          f"({fallback / native:.2f}x); greedy tokens equal in {same}/{args.num_prompts} requests")


if __name__ == "__main__":
    main()
