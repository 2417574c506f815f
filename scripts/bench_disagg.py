"""Prefill/decode disaggregation against colocated serving, two instances each, behind `kvtide router`.

    python scripts/bench_disagg.py [--model smollm2] [--num-prompts 24] [--request-rate 0.5]
        [--input-len 1024] [--output-len 64] [--output-json F]

Setups (127.0.0.1, free ports; each pinned by taskset to its own half of the cores, measured, then
stopped before the next starts):
  colocated   two `kvtide serve MODEL` behind `kvtide router --policy least_load`: each instance runs
              prefills and decodes of its requests in the same steps
  pd          `kvtide serve MODEL --kv-transfer-config {"kv_connector": "p2p", "kv_role": "kv_producer"}`
              and a kv_consumer, behind `kvtide router --prefill P --decode D`: prompts computed on
              one, handed over by the p2p connector, decoded on the other
Workload: `kvtide bench serve` random prompts of --input-len tokens (x [0.5, 1.5]: a mix of long and
short prompts) and --output-len tokens out, Poisson arrivals at --request-rate. Prints, per setup,
TTFT and TPOT (median and p99) and output throughput, with the CPU model and ISA. A decode step that
shares its instance with a prefill chunk waits for it: that is what the TPOT tail of colocated
serving pays, and what the pd setup moves to the other instance.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx


def halves() -> list[list[int]]:
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    return [cpus[:half], cpus[half:2 * half]] if half else [cpus, cpus]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(url)


@contextlib.contextmanager
def started(commands: list[tuple[list[str], str, dict]], log_dir: str) -> Iterator[None]:
    procs = []
    try:
        for i, (cmd, url, env) in enumerate(commands):
            log = open(os.path.join(log_dir, f"proc{i}.log"), "w")
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                           start_new_session=True), url))
        for proc, url in procs:
            wait_healthy(url, proc)
        yield
    finally:
        for proc, _ in reversed(procs):
            proc.terminate()
        for proc, _ in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def serve(model: str, port: int, cpus: list[int], args, connector: dict | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "kvtide.cli", "serve", model, "--port", str(port), "--dtype", "float32",
           "--max-model-len", str(int(args.input_len * 1.5) + args.output_len + 16),
           "--kv-cache-memory", args.kv_cache_memory, "--no-ui"]
    if connector is not None:
        cmd += ["--kv-transfer-config", json.dumps(connector)]
    taskset = shutil.which("taskset")
    return [taskset, "-c", ",".join(map(str, cpus)), *cmd] if taskset else cmd


def run_setup(setup: str, args, log_dir: str) -> dict:
    from kvtide.bench.peers import free_port

    a, b, router = free_port(), free_port(), free_port()
    url = lambda p: f"http://127.0.0.1:{p}"  # noqa: E731
    env = {"KVTIDE_KV_SECRET": secrets.token_hex(16)}
    first, second = halves()
    router_cmd = [sys.executable, "-m", "kvtide.cli", "router", "--port", str(router)]
    if setup == "pd":
        commands = [(serve(args.model, a, first, args, {"kv_connector": "p2p", "kv_role": "kv_producer"}), url(a), env),
                    (serve(args.model, b, second, args, {"kv_connector": "p2p", "kv_role": "kv_consumer"}), url(b), env)]
        router_cmd += ["--prefill", url(a), "--decode", url(b)]
    else:
        commands = [(serve(args.model, a, first, args), url(a), {}), (serve(args.model, b, second, args), url(b), {})]
        router_cmd += ["--backends", f"{url(a)},{url(b)}", "--policy", "least_load"]
    commands.append((router_cmd, url(router), {}))
    out_json = os.path.join(log_dir, f"{setup}.json")
    with started(commands, log_dir):
        subprocess.run([sys.executable, "-m", "kvtide.cli", "bench", "serve", "--base-url", url(router),
                        "--dataset-name", "random", "--random-input-len", str(args.input_len),
                        "--random-output-len", str(args.output_len), "--random-range-ratio", "0.5",
                        "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
                        "--seed", "0", "--disable-tqdm", "--output-json", out_json],
                       check=True, stdout=subprocess.DEVNULL)
    with open(out_json) as f:
        return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--request-rate", type=float, default=0.5)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    from kvtide.machine import describe_machine

    results = {}
    with tempfile.TemporaryDirectory(prefix="kvtide-bench-disagg-") as log_dir:
        for setup in ("colocated", "pd"):
            results[setup] = run_setup(setup, args, log_dir)
    print(describe_machine())
    print(f"{args.model}, random {args.input_len}x[0.5,1.5] in / {args.output_len} out, {args.num_prompts} requests "
          f"at {args.request_rate} req/s, 2 instances")
    print(f"{'setup':<10} {'TTFT med':>9} {'TTFT p99':>9} {'TPOT med':>9} {'TPOT p99':>9} {'out tok/s':>10} {'failed':>7}")
    for setup, r in results.items():
        print(f"{setup:<10} {r['median_ttft_ms']:9.0f} {r['p99_ttft_ms']:9.0f} {r['median_tpot_ms']:9.1f} "
              f"{r['p99_tpot_ms']:9.1f} {r['output_throughput']:10.1f} {sum(r['errors'].values()):7d}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
