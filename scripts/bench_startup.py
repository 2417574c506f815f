"""Process start to first token, in fresh processes: offline (`LLM(model)` + one generated token)
and served (`kvtide serve MODEL` until its first /v1/completions answer).

    python scripts/bench_startup.py                          # the bench checkpoint, 5 runs of each
    python scripts/bench_startup.py --model smollm2 --runs 3 --modes offline
    python scripts/bench_startup.py --cold --runs 1          # an empty $KVTIDE_CACHE for each run

Offline, the child process reads its own start time from /proc (so interpreter start-up counts)
and reports when the first token is back; served, the clock starts just before `kvtide serve` is
spawned and stops when the first completion has arrived (polled every 20 ms). A warm run first
(not reported) fills the caches: compiled kernels, GEMM verdicts, the built tokenizer. `--cold`
gives every run an empty cache instead (the checkpoint itself is resolved beforehand and stays).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from kvtide.bench.common import print_and_save, resolve_model
from kvtide.machine import describe_machine, machine_info

_OFFLINE_CHILD = """
import os, sys
from kvtide import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32")
llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=1))
with open("/proc/self/stat") as f:
    started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
with open("/proc/uptime") as f:
    now = float(f.read().split()[0])
print("FIRST_TOKEN_S", now - started, flush=True)
os._exit(0)
"""


def offline_run(model_dir: str, env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, "-c", _OFFLINE_CHILD, model_dir], env=env, capture_output=True,
                         text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("FIRST_TOKEN_S")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"offline run failed ({out.returncode}): {out.stderr[-2000:]}")
    return float(lines[-1].split()[1])


def served_run(model_dir: str, env: dict[str, str]) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    body = json.dumps({"model": model_dir, "prompt": "hi", "max_tokens": 1}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kvtide.cli", "serve", model_dir, "--host", "127.0.0.1",
                             "--port", str(port), "--dtype", "float32"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvtide serve exited with {proc.returncode} before answering")
            if time.perf_counter() - start > 900:
                raise RuntimeError("kvtide serve did not answer within 900 s")
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    response.read()
                return time.perf_counter() - start
            except OSError:
                time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="as `kvtide bench compare --model` (default: the bench checkpoint)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--modes", default="offline,served", help="comma-separated: offline, served")
    parser.add_argument("--cold", action="store_true", help="an empty $KVTIDE_CACHE for every run")
    parser.add_argument("--output-json", default=None, help="also write the machine and every time here")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    runners = {"offline": offline_run, "served": served_run}
    if unknown := set(modes) - set(runners):
        parser.error(f"--modes: unknown {sorted(unknown)}")
    model_dir = resolve_model(args.model)
    print(describe_machine())
    print(f"model {model_dir}, {'cold' if args.cold else 'warm'} cache")
    if not args.cold:
        offline_run(model_dir, dict(os.environ))  # fills the caches
    record = {"machine": machine_info(), "model": model_dir, "cold": args.cold, "seconds": {}}
    lines = []
    for mode in modes:
        times = record["seconds"][mode] = []
        for _ in range(args.runs):
            cold = (tempfile.TemporaryDirectory(prefix="kvtide-cold-", ignore_cleanup_errors=True) if args.cold
                    else contextlib.nullcontext())
            with cold as scratch:
                times.append(runners[mode](model_dir, {**os.environ, **({"KVTIDE_CACHE": scratch} if scratch else {})}))
        lines.append(f"{mode:8s} process start to first token: median {statistics.median(times):.2f} s, "
                     f"min {min(times):.2f}, max {max(times):.2f} ({' '.join(f'{t:.2f}' for t in times)})")
    return print_and_save(record, "\n".join(lines), args.output_json)


if __name__ == "__main__":
    sys.exit(main())
