"""What a constraint costs per step, with everything else held equal (offline, one process).

    python scripts/bench_structured_overhead.py [--model DIR] [--batch 32] [--rounds 5]

The json-schema prompts (kvtide.bench.json_schemas) run constrained, greedy, jump-forward off; then
the same prompts unconstrained with ignore_eos and each request's max_tokens set to the length its
constrained run produced. Both runs then take the very same schedule (same steps, same batch at
every step), so the difference in time per step is the constraint's own cost: bitmask fill and
application, matcher updates, the scheduler's hooks. Rounds alternate the two, and the minimum and
median over rounds are printed (a shared machine's noise is larger than the effect).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from kvtide import LLM, SamplingParams
from kvtide.bench.common import format_machine, machine_record
from kvtide.bench.json_schemas import json_schema_jobs
from kvtide.sampling_params import StructuredOutputsParams

DEFAULT_MODEL = os.path.expanduser("~/.cache/kvtide/bench-models/llama-h768-l12-v2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(model=args.model, device="cpu", max_model_len=1024,
              structured_outputs_config={"enable_jump_forward": False})
    jobs = json_schema_jobs(args.batch, 0)
    prompts = [prompt for prompt, _ in jobs]
    constrained = [SamplingParams(temperature=0, max_tokens=256, structured_outputs=StructuredOutputsParams(**so))
                   for _, so in jobs]

    def run(params) -> tuple[float, int, list[int]]:
        steps, start = llm.engine.core.num_steps, time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return elapsed / (llm.engine.core.num_steps - steps), llm.engine.core.num_steps - steps, \
            [len(o.outputs[0].token_ids) for o in outputs]

    _, _, lengths = run(constrained)  # compiles the grammars, warms up
    plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    times: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    for _ in range(args.rounds):
        for name, params in (("unconstrained", plain), ("constrained", constrained)):
            per_step, num_steps, _ = run(params)
            times[name].append(per_step * 1000)
    print(f"{args.batch} requests, {sum(lengths)} output tokens, {num_steps} steps per run, {args.rounds} rounds")
    print("| run | ms/step min | ms/step median |\n|---|---:|---:|")
    for name, values in times.items():
        print(f"| {name} | {min(values):.1f} | {statistics.median(values):.1f} |")
    ratio_min = min(times["constrained"]) / min(times["unconstrained"])
    ratio_med = statistics.median(times["constrained"]) / statistics.median(times["unconstrained"])
    print(f"constrained / unconstrained: {ratio_min:.3f} (min), {ratio_med:.3f} (median)")
    print(format_machine(machine_record(with_gemm=False)))


if __name__ == "__main__":
    main()
