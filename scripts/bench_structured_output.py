"""Structured output on `kvtide serve`: what the constraint costs, what jump-forward gives back, and
what a new schema costs its first request.

    python scripts/bench_structured_output.py                     # the bench checkpoint, 64 requests a mode
    python scripts/bench_structured_output.py --model smollm2 --num-prompts 128 --batch 32 --output-json so.json

In one run on this machine, against servers it starts on 127.0.0.1 (free ports) and always stops:
  1. a server with the default config (jump-forward on): the compile probe (below), then the
     json-schema workload (kvtide.bench.json_schemas) unconstrained (--structured-output-ratio 0),
     then the same prompts constrained;
  2. a fresh server with --structured-outputs-config '{"enable_jump_forward": false}': the probe, then
     the constrained workload again.
Each workload is `kvtide bench serve` (kvtide.bench.serve) with --max-concurrency --batch, all at once.
The probe sends, one at a time, a short request per distinct schema twice (each prompt unique, so the
prefix cache plays no part): the first pays the grammar compilation, the second finds it cached. The
workloads after it find every grammar compiled, so their TPOT and throughput are the steady state.

The markdown table it prints:
  output tok/s            output tokens over the run's wall time (forced tokens included)
  TPOT median / p99       per request (E2E - TTFT) / (output tokens - 1), over requests
  TPOT / unconstrained    median TPOT over the unconstrained run's median TPOT
  tokens / forward pass   server counters: generation tokens / (generation - jump-forward tokens)
  TTFT new / cached       the probe's median TTFT of a schema's first request and of its second
  compile ms              the server's compile time per schema (median; the first grammar of a server
                          also builds the vocabulary's tables, printed apart)
  valid %                 constrained completions that finished with "stop" and validate against
                          their schema ("length" ones counted apart as truncated)
followed by the machine line. The figures are as quiet as the machine is: measure on an idle one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import statistics
import sys
import tempfile
import uuid
from collections.abc import Iterator

import httpx

from kvtide.bench import client as oai
from kvtide.bench import peers
from kvtide.bench.common import format_machine, machine_record, resolve_model
from kvtide.bench.datasets import build_dataset, load_tokenizer_for_bench
from kvtide.bench.metrics import RequestRecord
from kvtide.bench.serve import _finite, add_serve_args, run_serve_benchmark

NO_JUMP_FORWARD = '{"enable_jump_forward": false}'
MODES = ("unconstrained", "constrained, jump-forward", "constrained, no jump-forward")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="checkpoint directory, GGUF file or built-in name (demo, smollm2); default: the "
                             "bench checkpoint (kvtide.bench.common)")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per mode")
    parser.add_argument("--batch", "--max-concurrency", dest="batch", type=int, default=32,
                        help="most requests in flight at once")
    parser.add_argument("--output-len", type=int, default=None, help="max_tokens (default: the dataset's, 256)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for a server")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for `kvtide serve` (repeat it), e.g. --server-arg=--kv-cache-memory "
                             "--server-arg=2GiB")
    parser.add_argument("--log-dir", default=None, help="where the server logs go (default: a temporary directory)")
    parser.add_argument("--output-json", default=None, help="write every mode's figures here")
    return parser.parse_args(argv)


@contextlib.contextmanager
def launched_server(args, model_dir: str, log_dir: str, name: str, extra: list[str]) -> Iterator[str]:
    """A `kvtide serve` of model_dir on a free port for the block; its URL. Stopped however the block ends."""
    port = peers.free_port()
    cmd = peers.server_command("kvtide", sys.executable, model_dir, port, args.max_model_len, 0,
                               extra=["--log-level", "warning", *extra, *args.server_arg])
    print(f"[structured-output] {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    server = peers.ServerProcess(f"kvtide-{name}", cmd, peers.peer_env("kvtide", 0), port, log_dir)
    try:
        ready = server.wait_ready(args.startup_timeout)
        if not ready["ok"]:
            raise RuntimeError(ready["error"])
        yield server.url
    finally:
        server.close()


def serve_args(args, url: str, model_dir: str, ratio: float) -> argparse.Namespace:
    """`kvtide bench serve` flags for one mode: the json-schema workload, all requests at once."""
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    argv = ["--base-url", url, "--tokenizer", model_dir, "--dataset-name", "json-schema",
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.batch), "--seed", str(args.seed),
            "--structured-output-ratio", str(ratio), "--disable-tqdm"]
    if args.output_len is not None:
        argv += ["--output-len", str(args.output_len)]
    return parser.parse_args(argv)


def run_mode(args, url: str, model_dir: str, tokenizer, ratio: float) -> dict:
    result = asyncio.run(run_serve_benchmark(serve_args(args, url, model_dir, ratio), tokenizer=tokenizer))
    for key in ("_records", "_t0", "_running_samples"):
        result.pop(key, None)
    return result


async def compile_probe(url: str, constraints: list[dict]) -> dict:
    """Per distinct constraint, two short requests one after the other: TTFT with the grammar new to
    the server, then with it cached; and the server's compile time of each (its histogram's _sum)."""
    endpoint = url + "/v1/completions"
    options = oai.PayloadOptions(ignore_eos=False, include_usage=True)
    new_ttft, cached_ttft, compile_ms = [], [], []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0)) as http:
        model = await oai.fetch_first_model(http, url)
        warm = RequestRecord(prompt_len=0, expected_output_len=1)  # a fresh server's first step is slow
        await oai.send_completion(http, endpoint, oai.build_payload(model, "Hello. JSON:", 1, options), warm)
        for constraint in constraints:
            for ttfts in (new_ttft, cached_ttft):
                before = await oai.scrape_metrics(http, url)
                record = RequestRecord(prompt_len=0, expected_output_len=1, structured_outputs=constraint)
                prompt = f"Request {uuid.uuid4().hex}. JSON:"  # unique: no prefix-cache hit
                await oai.send_completion(http, endpoint, oai.build_payload(model, prompt, 1, options, constraint),
                                          record)
                if not record.success or record.ttft is None:
                    raise RuntimeError(f"compile probe request failed: {record.error}")
                ttfts.append(record.ttft)
                after = await oai.scrape_metrics(http, url)
                if ttfts is new_ttft and before and after:
                    name = "kvtide:structured_output_grammar_compile_seconds_sum"
                    compile_ms.append(1000.0 * (after.get(name, 0.0) - before.get(name, 0.0)))
    return {"num_schemas": len(constraints),
            "ttft_new_schema_ms": 1000.0 * statistics.median(new_ttft),
            "ttft_cached_schema_ms": 1000.0 * statistics.median(cached_ttft),
            "compile_ms": compile_ms,
            "first_compile_ms": compile_ms[0] if compile_ms else None,
            "compile_median_ms": statistics.median(compile_ms[1:]) if len(compile_ms) > 1 else None}


def distinct_constraints(args, tokenizer) -> list[dict]:
    """The workload's constraints, each once, in the order the run first sends them."""
    ns = serve_args(args, "http://unused", "", 1.0)
    seen: dict[str, dict] = {}
    for job in build_dataset(ns, tokenizer):
        if job.structured_outputs is not None:
            seen.setdefault(json.dumps(job.structured_outputs, sort_keys=True), job.structured_outputs)
    return list(seen.values())


def measure(args) -> dict:
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer_for_bench(None, model_dir)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvtide-structured-output-")
    constraints = distinct_constraints(args, tokenizer)
    modes: dict[str, dict] = {}
    probes: dict[str, dict] = {}
    with launched_server(args, model_dir, log_dir, "jump-forward", []) as url:
        probes[MODES[1]] = asyncio.run(compile_probe(url, constraints))
        modes[MODES[0]] = run_mode(args, url, model_dir, tokenizer, 0.0)
        modes[MODES[1]] = run_mode(args, url, model_dir, tokenizer, 1.0)
    with launched_server(args, model_dir, log_dir, "no-jump-forward",
                         ["--structured-outputs-config", NO_JUMP_FORWARD]) as url:
        probes[MODES[2]] = asyncio.run(compile_probe(url, constraints))
        modes[MODES[2]] = run_mode(args, url, model_dir, tokenizer, 1.0)
    return {"model": model_dir, "num_prompts": args.num_prompts, "max_concurrency": args.batch, "seed": args.seed,
            "modes": modes, "compile_probe": probes, "log_dir": log_dir, "machine": machine_record(with_gemm=False)}


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return format(value, spec)


def markdown_table(summary: dict) -> str:
    """The table of the module docstring, one row per mode, then the probe's first-grammar note."""
    header = ("| mode | requests | output tok/s | TPOT median / p99 ms | TPOT / unconstrained | "
              "output tokens / forward pass | TTFT ms new / cached schema | compile ms | valid % |")
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    reference = summary["modes"].get(MODES[0], {}).get("median_tpot_ms")
    for mode, result in summary["modes"].items():
        figures = result.get("structured_output") or {}
        server = figures.get("server") or {}
        probe = summary.get("compile_probe", {}).get(mode)
        constrained = figures.get("num_constrained_requests", 0)
        tpot = result.get("median_tpot_ms")
        ratio = tpot / reference if tpot and reference else None
        requests = f"{result['completed']}" + (f" ({constrained} constrained)" if constrained else "")
        if result.get("failed"):
            requests += f", {result['failed']} failed"
        ttft = f"{_fmt(probe['ttft_new_schema_ms'], '.1f')} / {_fmt(probe['ttft_cached_schema_ms'], '.1f')}" \
            if probe else "–"
        valid = "–"
        if constrained:
            valid = _fmt(100 * figures["valid_rate"] if figures.get("valid_rate") is not None else None, ".1f")
            if figures.get("num_truncated"):
                valid += f" ({figures['num_truncated']} truncated)"
        lines.append(" | ".join([
            f"| {mode}", requests, _fmt(result.get("output_throughput"), ".1f"),
            f"{_fmt(tpot, '.2f')} / {_fmt(result.get('p99_tpot_ms'), '.2f')}", _fmt(ratio, ".2f"),
            _fmt(server.get("output_tokens_per_forward_pass"), ".2f"), ttft,
            _fmt(probe.get("compile_median_ms") if probe else None, ".2f"), valid]) + " |")
    firsts = [p["first_compile_ms"] for p in summary.get("compile_probe", {}).values() if p.get("first_compile_ms")]
    if firsts:
        lines.append("")
        lines.append(f"A server's first grammar (vocabulary tables included) took "
                     f"{' and '.join(_fmt(ms, '.0f') for ms in firsts)} ms to compile.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        summary = measure(args)
    except (RuntimeError, ValueError) as e:  # a server that did not start, a probe request that failed
        print(f"bench_structured_output: error: {e}", file=sys.stderr)
        return 2
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(_finite(summary), f, indent=2)
    print(f"model {summary['model']}: {args.num_prompts} json-schema requests per mode, "
          f"{args.batch} at once, seed {args.seed}")
    print()
    print(markdown_table(summary))
    print()
    print(format_machine(summary["machine"]))
    return 0 if all(r["completed"] == r["num_requests"] for r in summary["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
