"""Speculative decoding against batch size: where verification stops paying (disable_by_batch_size).

Offline throughput of B grounded chat requests at once (bench/datasets.py grounded_conversations,
cycled; greedy, EOS ignored), for each B: speculation off, forced on at every batch size
(disable_by_batch_size above B), and the default adaptive rule. Prints output tokens/s and each
one's ratio to off (medians of interleaved runs), with the machine line. The three engines are
loaded side by side once.

    python scripts/bench_spec_batch.py --model smollm2 --batch-sizes 1,4,16,32,64 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvtide import LLM, SamplingParams
from kvtide.bench.datasets import grounded_dataset
from kvtide.machine import describe_machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch-sizes", default="1,4,16,32,64")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 5}')
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per point; the median counts")
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    spec = json.loads(args.speculative_config)
    variants = {"off": None, "forced": {**spec, "disable_by_batch_size": max(sizes) + 1}, "adaptive": spec}
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engines = {name: LLM(model=args.model, device="cpu", dtype="float32", max_model_len=1024, kv_cache_memory="1GiB",
                         speculative_config=config, enable_prefix_caching=False) for name, config in variants.items()}
    tokenizer = engines["off"].get_tokenizer()
    prompts = [{"prompt_token_ids": job.prompt_token_ids}
               for job in grounded_dataset(tokenizer, max(sizes), args.output_len)]
    for llm in engines.values():
        llm.generate(prompts[:2], params)  # warm-up
    runs: dict[str, dict[int, list[float]]] = {name: {b: [] for b in sizes} for name in variants}
    for b in sizes:
        for _ in range(args.repeats):  # interleaved, so drift in the machine's speed hits every variant alike
            for name, llm in engines.items():
                start = time.perf_counter()
                outputs = llm.generate(prompts[:b], params)
                elapsed = time.perf_counter() - start
                runs[name][b].append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    results = {name: {b: statistics.median(v) for b, v in per_b.items()} for name, per_b in runs.items()}
    print(describe_machine())
    print(f"model {args.model}, grounded chat requests, {args.output_len} output tokens, speculative config {spec}")
    print(f"{'batch':>6} " + " ".join(f"{name:>18}" for name in variants))
    for b in sizes:
        off = results["off"][b]
        cells = [f"{results[name][b]:8.1f} ({results[name][b] / off:4.2f}x)" for name in variants]
        print(f"{b:>6} " + " ".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()
