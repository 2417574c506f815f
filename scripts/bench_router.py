"""`kvtide router` policies on the same backends and the same prompts: prefix-cache hit rate, TTFT
and throughput per policy.

    python scripts/bench_router.py                                  # the bench checkpoint, 2 backends
    python scripts/bench_router.py --model demo --num-prompts 16 --output-len 8

How a run goes: N `kvtide serve MODEL` backends start on free 127.0.0.1 ports (each pinned with
taskset to its share of the cores when there are enough) with --enable-admin-api; then for each
policy in --policies: the backends' prefix caches are reset (POST /reset_prefix_cache), a
`kvtide router --policy P` starts in front of them, `kvtide bench serve` (kvtide.bench.serve, run
in this process) sends the workload to the router, the backends' own prefix-cache counters are read
before and after (hit rate = hit tokens / looked-up tokens over the run, summed over the backends),
and the router stops. Everything is stopped in a finally.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx

POLICIES = ("round_robin", "least_load", "cache_aware")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory or built-in name (default: the bench "
                                                      "checkpoint of kvtide.bench.common, ~110M random Llama)")
    parser.add_argument("--num-backends", type=int, default=2)
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, run in this order")
    parser.add_argument("--dataset-name", default="shared-prefix", choices=("shared-prefix", "multi-turn"))
    parser.add_argument("--num-prompts", type=int, default=32, help="requests (multi-turn: conversations)")
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--num-turns", type=int, default=3, help="multi-turn: turns per conversation")
    parser.add_argument("--turn-input-len", type=int, default=96, help="multi-turn: new tokens per turn")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="256MiB", help="per backend")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = set(args.policies) - set(POLICIES)
    if unknown or not args.policies:
        parser.error(f"--policies: choose among {', '.join(POLICIES)}")
    if args.num_backends < 1:
        parser.error("--num-backends must be >= 1")
    return args


def _cpu_shares(n: int) -> list[list[int]]:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    per = len(cpus) // n
    return [cpus[i * per:(i + 1) * per] for i in range(n)] if per else [cpus] * n


ADMIN_KEY = "bench-admin-key"
"""The backends' --admin-api-key (their /internal/stats holds the prefix-cache counters)."""


@contextlib.contextmanager
def backends(args, model_dir: str, log_dir: str) -> Iterator[list[str]]:
    from kvtide.bench import peers

    extra = ["--log-level", "warning", "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs",
             str(args.max_num_seqs), "--enable-admin-api", "--admin-api-key", ADMIN_KEY]
    taskset = shutil.which("taskset")
    started: list = []
    try:
        for i, cpus in enumerate(_cpu_shares(args.num_backends)):
            port = peers.free_port()
            cmd = peers.server_command("kvtide", sys.executable, model_dir, port, args.max_model_len, 0, extra=extra)
            if taskset:
                cmd = [taskset, "-c", ",".join(map(str, cpus)), *cmd]
            started.append(peers.ServerProcess(f"backend{i}", cmd, peers.peer_env("kvtide", 0), port, log_dir))
        for server in started:
            ready = server.wait_ready(args.startup_timeout)
            if not ready["ok"]:
                raise RuntimeError(ready["error"])
        yield [s.url for s in started]
    finally:
        for server in started:
            server.close()


@contextlib.contextmanager
def router(policy: str, urls: list[str], log_dir: str) -> Iterator[str]:
    from kvtide.bench.peers import free_port, peer_env

    port = free_port()
    with open(os.path.join(log_dir, f"router-{policy}.log"), "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvtide.cli", "router", "--backends", ",".join(urls),
                                 "--policy", policy, "--port", str(port), "--log-level", "warning"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=peer_env("kvtide", 0))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"router exited with {proc.returncode} (log in {log_dir})")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("router not healthy in 60 s")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def prefix_counters(urls: list[str]) -> tuple[float, float]:
    """(looked-up tokens, hit tokens) summed over the backends' engines."""
    queries = hits = 0.0
    for url in urls:
        stats = httpx.get(url + "/internal/stats", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                          timeout=10.0).json()
        queries += stats["prefix_cache_queries"]
        hits += stats["prefix_cache_hits"]
    return queries, hits


def router_counters(url: str) -> dict[str, float]:
    """The router's own counts over its life (warm-up included): requests by prefix match and by
    load (cache_aware only), retries."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = {"prefix_match": 0.0, "load": 0.0, "retries": 0.0}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10.0).text):
        for sample in family.samples:
            if sample.name == "kvtide_router_routing_decisions_total":
                counts[sample.labels["decision"]] += sample.value
            elif sample.name == "kvtide_router_retries_total":
                counts["retries"] += sample.value
    return counts


def bench_args(args, url: str, model_dir: str) -> argparse.Namespace:
    from kvtide.bench.serve import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args([
        "--base-url", url, "--tokenizer", model_dir, "--dataset-name", args.dataset_name, "--num-prompts",
        str(args.num_prompts), "--max-concurrency", str(args.max_concurrency), "--seed", str(args.seed),
        "--output-len", str(args.output_len), "--num-prefixes", str(args.num_prefixes), "--prefix-len",
        str(args.prefix_len), "--suffix-len", str(args.suffix_len), "--num-turns", str(args.num_turns),
        "--random-input-len", str(args.turn_input_len),
        "--disable-tqdm", "--metrics-interval", "5"])


def run_policy(args, policy: str, urls: list[str], model_dir: str, tokenizer, log_dir: str) -> dict:
    from kvtide.bench.serve import run_serve_benchmark

    for url in urls:  # every policy starts from cold caches
        reset = httpx.post(url + "/reset_prefix_cache", timeout=30.0).json()
        if not reset.get("reset"):
            raise RuntimeError(f"{url}: prefix cache not reset (requests still running?)")
    with router(policy, urls, log_dir) as url:
        queries0, hits0 = prefix_counters(urls)
        result = asyncio.run(run_serve_benchmark(bench_args(args, url, model_dir), tokenizer=tokenizer))
        queries1, hits1 = prefix_counters(urls)
        result["router"] = router_counters(url)
    result["prefix_cache_hit_rate"] = (hits1 - hits0) / (queries1 - queries0) if queries1 > queries0 else None
    return result


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kvtide.bench.common import resolve_model
    from kvtide.bench.datasets import load_tokenizer_for_bench
    from kvtide.machine import cpu_model_name, describe_machine

    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer_for_bench(None, model_dir)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvtide-router-bench-")
    results = {}
    with backends(args, model_dir, log_dir) as urls:
        for policy in args.policies:
            results[policy] = run_policy(args, policy, urls, model_dir, tokenizer, log_dir)
    print(f"model {model_dir}; {args.num_backends} backends; dataset {args.dataset_name}: {args.num_prompts} "
          f"{'conversations' if args.dataset_name == 'multi-turn' else 'requests'}, {args.max_concurrency} at once, "
          f"output {args.output_len} tokens" + (f", {args.num_prefixes} prefixes of {args.prefix_len} + "
                                                f"{args.suffix_len} tokens" if args.dataset_name == "shared-prefix"
                                                else f", {args.num_turns} turns"))
    print("| policy | completed | prefix-cache hit % | TTFT mean ms | TTFT p99 ms | req/s | output tok/s | "
          "routed by prefix / by load | retries |")
    print("|---|---|---|---|---|---|---|---|---|")
    for policy, r in results.items():
        hit, counts = r["prefix_cache_hit_rate"], r["router"]
        decided = f"{counts['prefix_match']:.0f} / {counts['load']:.0f}" if policy == "cache_aware" else "-"
        print(f"| {policy} | {r['completed']} | {_fmt(100 * hit if hit is not None else None, '.1f')} | "
              f"{_fmt(r.get('mean_ttft_ms'), '.1f')} | {_fmt(r.get('p99_ttft_ms'), '.1f')} | "
              f"{_fmt(r.get('request_throughput'), '.2f')} | {_fmt(r.get('output_throughput'), '.1f')} | "
              f"{decided} | {counts['retries']:.0f} |")
    print(f"CPU: {cpu_model_name()}")
    print(describe_machine())
    print(f"logs: {log_dir}")
    return 0 if all(r["completed"] == r["num_requests"] for r in results.values()) else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
