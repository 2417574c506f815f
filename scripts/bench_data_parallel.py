"""Data parallelism on `kvtide serve`: one server with --data-parallel-size 2 against two independent
servers behind `kvtide router --policy round_robin`, on the same machine, the same prompts, in one run.

    python scripts/bench_data_parallel.py                          # the bench checkpoint
    python scripts/bench_data_parallel.py --model demo --num-prompts 32 --output-json dp.json

Setups (each started on 127.0.0.1 free ports, measured, then stopped before the next starts):
  dp=2          `kvtide serve MODEL --data-parallel-size 2`: one API process, two engine-core replicas,
                each pinned to half the cores; requests balanced by load and prefix affinity
  2 servers+rr  two `kvtide serve MODEL`, each pinned (taskset) to half the cores, behind
                `kvtide router --policy round_robin`
Workloads (kvtide.bench.serve, all requests queued at once, at most --max-concurrency in flight):
  shared-prefix --num-prefixes prefixes of --prefix-len tokens, each request adds --suffix-len
  random        --random-input-len tokens, nothing shared
The table: request and output-token throughput, median TTFT and TPOT, the prefix-cache hit rate over
the run (summed over the engines' own counters) and how many requests each engine served (both
counts include the workload's one warm-up request), and the 1-minute load average before and after
(a busy machine shows there). --rounds 2 runs A B then B A.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx

SETUPS = ("dp=2", "2 servers+rr")
WORKLOADS = ("shared-prefix", "random")


# ---- servers ------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory or built-in name (default: the bench "
                                                      "checkpoint, kvtide.bench.common)")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per workload")
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--random-input-len", type=int, default=288, help="default: prefix + suffix")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-memory", default="256MiB", help="per engine (replica or server)")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1, help="repeat the setups (A B, B A, ...)")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="one more `kvtide serve` argument for every server (repeat it)")
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--output-json", default=None)
    return parser.parse_args(argv)


def _halves() -> list[list[int]]:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    half = len(cpus) // 2
    return [cpus[:half], cpus[half:2 * half]] if half else [cpus, cpus]


@contextlib.contextmanager
def servers(args, model_dir: str, log_dir: str, setup: str) -> Iterator[tuple[str, list[str]]]:
    """Start a setup; yields (the URL the workload goes to, the engine servers' URLs)."""
    from kvtide.bench import peers

    extra = ["--log-level", "warning", "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs",
             str(args.max_num_seqs), *args.server_arg]
    started: list[peers.ServerProcess] = []
    try:
        if setup == "dp=2":
            port = peers.free_port()
            cmd = peers.server_command("kvtide", sys.executable, model_dir, port, args.max_model_len, 0,
                                       extra=[*extra, "--data-parallel-size", "2"])
            started.append(peers.ServerProcess("kvtide-dp2", cmd, peers.peer_env("kvtide", 0), port, log_dir))
        else:
            taskset = shutil.which("taskset")
            for i, cpus in enumerate(_halves()):
                port = peers.free_port()
                cmd = peers.server_command("kvtide", sys.executable, model_dir, port, args.max_model_len, 0,
                                           extra=extra)
                if taskset:  # each server (API and engine core) on its half, as the DP replicas are
                    cmd = [taskset, "-c", ",".join(map(str, cpus)), *cmd]
                started.append(peers.ServerProcess(f"kvtide-server{i}", cmd, peers.peer_env("kvtide", 0), port,
                                                   log_dir))
        for server in started:
            print(f"[dp-bench] {setup}: {' '.join(server.proc.args)}", file=sys.stderr, flush=True)
            ready = server.wait_ready(args.startup_timeout)
            if not ready["ok"]:
                raise RuntimeError(ready["error"])
        backends = [s.url for s in started]
        if setup == "dp=2":
            yield backends[0], backends
            return
        port = peers.free_port()
        cmd = [sys.executable, "-m", "kvtide.cli", "router", "--backends", ",".join(backends),
               "--policy", "round_robin", "--port", str(port)]
        proxy = peers.ServerProcess("rr-router", cmd, dict(os.environ), port, log_dir)
        started.append(proxy)
        ready = proxy.wait_ready(60)
        if not ready["ok"]:
            raise RuntimeError(ready["error"])
        yield proxy.url, backends
    finally:
        for server in reversed(started):
            server.close()


async def _scrape(urls: list[str]) -> list[dict[str, float]]:
    """Per server: sample name -> value summed over labels, and per-engine samples also as
    'NAME{engine="i"}'."""
    from prometheus_client.parser import text_string_to_metric_families

    scrapes = []
    async with httpx.AsyncClient() as http:
        for url in urls:
            values: dict[str, float] = {}
            text = (await http.get(f"{url}/metrics", timeout=10.0)).text
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
                    if "engine" in sample.labels:
                        key = f'{sample.name}{{engine="{sample.labels["engine"]}"}}'
                        values[key] = values.get(key, 0.0) + float(sample.value)
            scrapes.append(values)
    return scrapes


def _engine_requests(scrapes: list[dict[str, float]], url_count: int) -> list[float]:
    """Requests each engine served: per replica (dp) or per server (finished requests)."""
    if url_count == 1:
        values = scrapes[0]
        return [values.get(f'kvtide:data_parallel_requests_total{{engine="{e}"}}', 0.0) for e in (0, 1)]
    return [s.get("kvtide:request_success_total", 0.0) for s in scrapes]


def serve_args(args, url: str, model_dir: str, workload: str) -> argparse.Namespace:
    from kvtide.bench.serve import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    argv = ["--base-url", url, "--tokenizer", model_dir, "--dataset-name", workload, "--num-prompts",
            str(args.num_prompts), "--max-concurrency", str(args.max_concurrency), "--seed", str(args.seed),
            "--output-len", str(args.output_len), "--disable-tqdm", "--num-prefixes", str(args.num_prefixes),
            "--prefix-len", str(args.prefix_len), "--suffix-len", str(args.suffix_len),
            "--random-input-len", str(args.random_input_len), "--metrics-interval", "5"]
    return parser.parse_args(argv)


def run_workload(args, url: str, backends: list[str], model_dir: str, tokenizer, workload: str) -> dict:
    from kvtide.bench.serve import run_serve_benchmark

    ns = serve_args(args, url, model_dir, workload)
    before = asyncio.run(_scrape(backends))
    result = asyncio.run(run_serve_benchmark(ns, tokenizer=tokenizer))
    after = asyncio.run(_scrape(backends))
    for key in ("_records", "_t0", "_running_samples", "ttft", "tpot", "itl", "e2el", "machine"):
        result.pop(key, None)
    queries = sum(a.get("kvtide:prefix_cache_queries_total", 0.0) - b.get("kvtide:prefix_cache_queries_total", 0.0)
                  for a, b in zip(after, before, strict=True))
    hits = sum(a.get("kvtide:prefix_cache_hits_total", 0.0) - b.get("kvtide:prefix_cache_hits_total", 0.0)
               for a, b in zip(after, before, strict=True))
    result["engines_prefix_cache_hit_rate"] = hits / queries if queries else None
    result["engine_requests"] = [a - b for a, b in zip(_engine_requests(after, len(backends)),
                                                       _engine_requests(before, len(backends)), strict=True)]
    return result


def measure(args) -> dict:
    from kvtide.bench.common import machine_record, resolve_model
    from kvtide.bench.datasets import load_tokenizer_for_bench

    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer_for_bench(None, model_dir)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvtide-dp-bench-")
    runs: list[dict] = []
    for round_ in range(args.rounds):
        # A B, then B A: a machine that gets busier or quieter over the run favours neither.
        for setup in SETUPS if round_ % 2 == 0 else tuple(reversed(SETUPS)):
            started = time.perf_counter()
            with servers(args, model_dir, log_dir, setup) as (url, backends):
                print(f"[dp-bench] {setup}: ready in {time.perf_counter() - started:.1f} s", file=sys.stderr,
                      flush=True)
                load = os.getloadavg()[0]
                results = {w: run_workload(args, url, backends, model_dir, tokenizer, w) for w in WORKLOADS}
                runs.append({"setup": setup, "round": round_, "load_before": load, "load_after": os.getloadavg()[0],
                             "results": results})
    return {"model": model_dir, "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
            "output_len": args.output_len, "seed": args.seed, "runs": runs, "log_dir": log_dir,
            "machine": machine_record(with_gemm=False)}


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return format(value, spec)


def markdown_table(summary: dict) -> str:
    header = ("| workload | setup | round | requests | req/s | output tok/s | TTFT median ms | TPOT median ms | "
              "prefix-cache hit % | requests per engine | load avg before/after |")
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for workload in WORKLOADS:
        for run in sorted(summary["runs"], key=lambda run: (SETUPS.index(run["setup"]), run["round"])):
            r = run["results"][workload]
            done = f"{r['completed']}" + (f" ({r['failed']} failed)" if r.get("failed") else "")
            hit = r.get("engines_prefix_cache_hit_rate")
            lines.append(" | ".join([
                f"| {workload}", run["setup"], str(run["round"] + 1), done, _fmt(r.get("request_throughput"), ".2f"),
                _fmt(r.get("output_throughput"), ".1f"), _fmt(r.get("median_ttft_ms"), ".0f"),
                _fmt(r.get("median_tpot_ms"), ".1f"), _fmt(100 * hit if hit is not None else None, ".1f"),
                " / ".join(f"{n:.0f}" for n in r["engine_requests"]),
                f"{run['load_before']:.1f} / {run['load_after']:.1f}"]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kvtide.bench.common import format_machine
    from kvtide.bench.serve import _finite

    try:
        summary = measure(args)
    except (RuntimeError, ValueError) as e:
        print(f"bench_data_parallel: error: {e}", file=sys.stderr)
        return 2
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(_finite(summary), f, indent=2)
    print(f"model {summary['model']}: {args.num_prompts} requests per workload, {args.max_concurrency} at once, "
          f"output {args.output_len} tokens, seed {args.seed}")
    print()
    print(markdown_table(summary))
    print()
    print(format_machine(summary["machine"]))
    ok = all(r["completed"] == r["num_requests"] for run in summary["runs"] for r in run["results"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
