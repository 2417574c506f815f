"""GFLOP/s of each CPU GEMM candidate (kvtide/layers/cpu_gemm.py) on the bench model's and SmolLM2's
linear shapes, at decode and prefill row counts, on this machine.

    python scripts/bench_cpu_gemm.py [--rows 1,8,64,256,1024] [--rounds 7] [--output-json F]

Candidates are timed in interleaved rounds (each round runs every candidate once, for at least
--min-sample-ms), so a busy moment slows all of them alike; the table shows the median over rounds,
the best round (what the kernel does when nothing else runs), and in brackets the spread (slowest
round / fastest round - 1) as the noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from kvtide.layers import cpu_gemm
from kvtide.machine import describe_machine, machine_info

SHAPES = {
    # name: (N, K, bias)
    "bench qkv": (1280, 768, False), "bench o": (768, 768, False), "bench gate_up": (4096, 768, False),
    "bench down": (768, 2048, False), "bench lm_head": (32000, 768, False),
    "smollm2 qkv": (960, 576, False), "smollm2 o": (576, 576, False), "smollm2 gate_up": (3072, 576, False),
    "smollm2 down": (576, 1536, False), "smollm2 lm_head": (49152, 576, False),
}


def time_rounds(fns: dict, rounds: int, min_sample_s: float) -> dict[str, list[float]]:
    """Seconds per call of each fn, one sample per round, the rounds interleaved across fns."""
    repeat = {}
    for name, fn in fns.items():
        fn()
        start = time.perf_counter()
        fn()
        repeat[name] = max(1, int(min_sample_s / max(time.perf_counter() - start, 1e-7)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(repeat[name]):
                fn()
            samples[name].append((time.perf_counter() - start) / repeat[name])
    return samples


def bench_shape(n: int, k: int, has_bias: bool, rows_list: list[int], rounds: int, min_sample_s: float) -> dict:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=gen) * 0.02
    bias = torch.randn(n, generator=gen) * 0.02 if has_bias else None
    names = cpu_gemm.available_candidates()
    packed = {name: cpu_gemm.CANDIDATES[name].prepare(weight) for name in names if cpu_gemm.CANDIDATES[name].prepare}
    out = {}
    for rows in rows_list:
        x = torch.randn(rows, k, generator=gen)
        ok = set(cpu_gemm._passing(x, weight, bias, names, packed))
        fns = {name: cpu_gemm._bound_call(name, x, weight, bias, packed.get(name)) for name in names}
        samples = time_rounds(fns, rounds, min_sample_s)
        flops = 2 * rows * n * k
        out[rows] = {name: {"gflop_s_median": flops / statistics.median(s) / 1e9,
                            "gflop_s_best": flops / min(s) / 1e9, "spread": max(s) / min(s) - 1,
                            "numerics_ok": name in ok} for name, s in samples.items()}
    return out


def format_table(label: str, shape: tuple[int, int, bool], results: dict) -> str:
    names = list(next(iter(results.values())))
    lines = [f"{label} ({shape[0]}x{shape[1]}{'+bias' if shape[2] else ''}): GFLOP/s, median/best round [spread]"]
    lines.append(f"  {'M':>5} " + "".join(f"{name:>24}" for name in names) + "   fastest (best round)")
    for rows, by_name in results.items():
        cells = []
        for name in names:
            r = by_name[name]
            mark = "" if r["numerics_ok"] else "!"
            cells.append(f"{r['gflop_s_median']:6.1f}/{r['gflop_s_best']:5.1f} [{r['spread']:3.0%}]{mark:1}".rjust(24))
        fastest = max((n for n in names if by_name[n]["numerics_ok"]), key=lambda n: by_name[n]["gflop_s_best"])
        lines.append(f"  {rows:>5} " + "".join(cells) + f"   {fastest}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,64,256,1024", help="row counts M")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--min-sample-ms", type=float, default=2.0)
    parser.add_argument("--shapes", default=None, help="comma-separated names from SHAPES (default: all)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = {k: SHAPES[k] for k in args.shapes.split(",")} if args.shapes else SHAPES
    info = machine_info()
    print(describe_machine(info), flush=True)
    report: dict = {"machine": info, "shapes": {}}
    for label, shape in shapes.items():
        results = bench_shape(*shape, rows_list, args.rounds, args.min_sample_ms / 1000)
        report["shapes"][label] = {"shape": shape, "rows": results}
        print(format_table(label, shape, results), flush=True)
    print("(! = fails the numerics bound; spread = slowest/fastest round - 1)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
