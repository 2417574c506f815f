"""`kvtide bench serve`: load any OpenAI-compatible /v1/completions server and report its latencies.

    kvtide bench serve --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 128 --random-output-len 128 --num-prompts 200 --request-rate 4

How a run goes:
  1. build the dataset (deterministic in --seed) and load a tokenizer to size prompts;
  2. warm-up requests (not measured) that also probe which extensions the server accepts
     (ignore_eos, stream_options.include_usage);
  3. scrape /metrics (kvtide:/vllm: counters) as the "before" point;
  4. send the jobs: arrivals from a gamma process with mean rate --request-rate and shape
     --burstiness (1 = Poisson; inf rate = all at once), at most --max-concurrency in flight; the
     turns of a conversation go one after another, each with the history so far;
  5. scrape /metrics again, compute the metrics (kvtide.bench.metrics), print, write JSON and plots.

Structured output: with a dataset that pairs prompts with constraints (--dataset-name json-schema, or
a JSONL file whose items carry "schema" or "structured_outputs"), the jobs that
--structured-output-ratio picks send theirs as vLLM's `structured_outputs` (and no ignore_eos or
min_tokens); the warm-up checks the server accepts one; the report gains a "Structured Output"
section (kvtide.bench.structured_figures): validity of the completions, grammars compiled, cache
hits, compile time, jump-forward tokens and output tokens per forward pass. With and without
constraints on the same prompts is two runs:

    kvtide bench serve --base-url URL --dataset-name json-schema --num-prompts 64 --max-concurrency 32
    kvtide bench serve --base-url URL --dataset-name json-schema --num-prompts 64 --max-concurrency 32 \\
        --structured-output-ratio 0

scripts/bench_structured_output.py runs both, and jump-forward off, against servers it starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from datetime import datetime

import httpx
import numpy as np

from kvtide.bench import client as oai
from kvtide.bench.arrivals import arrival_offsets
from kvtide.bench.common import format_machine, machine_record
from kvtide.bench.datasets import (
    Conversation,
    add_dataset_args,
    build_dataset,
    load_tokenizer_for_bench,
    render_turn_prompt,
)
from kvtide.bench.metrics import (
    RequestRecord,
    compute_serving_metrics,
    format_report,
    parse_goodput,
    parse_percentiles,
)
from kvtide.bench.structured_figures import structured_output_summary


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--backend", choices=sorted(oai.BACKENDS) + ["openai-embeddings", "rerank"], default="openai",
                        help="openai: /v1/completions; openai-chat: /v1/chat/completions (the prompt as one user "
                             "message); openai-responses: /v1/responses (the prompt as its input); "
                             "openai-embeddings or rerank: a pooling server's /v1/embeddings or /v1/rerank "
                             "(kvtide/bench/pooling.py)")
    parser.add_argument("--endpoint", default=None, help="path of the API (default: the backend's)")
    parser.add_argument("--embedding-batch-size", type=int, default=1, help="openai-embeddings: texts per request")
    parser.add_argument("--rerank-documents", type=int, default=100, help="rerank: documents per query")
    parser.add_argument("--model", default=None, help="model name for requests (default: the first of /v1/models)")
    add_dataset_args(parser)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="mean requests (conversations) started per second; inf sends all at once")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="shape of the gamma inter-arrival distribution: 1 Poisson, <1 burstier, >1 steadier")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--num-warmups", type=int, default=1, help="unmeasured requests sent first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="do not ask the server to ignore EOS (asked by default where accepted)")
    parser.add_argument("--send-min-tokens", action="store_true",
                        help="also send min_tokens = max_tokens, for servers that ignore ignore_eos "
                             "(llama-cpp-python's server)")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:50 (keys: ttft, tpot, e2el)")
    parser.add_argument("--metric-percentiles", default="90,99,99.9",
                        help="percentiles reported for TTFT, TPOT, ITL and E2E (mean and median always)")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--output-json", default=None, help="write the result (with per-request detail) here")
    parser.add_argument("--plot-dir", default=None,
                        help="write PNG plots here (default: beside --output-json; needs matplotlib)")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--metrics-interval", type=float, default=0.5,
                        help="seconds between /metrics polls for the running-requests plot")


class ServeRun:
    """One benchmark run's state: the HTTP client, the limits, the records, the metrics poll."""

    def __init__(self, args, http: httpx.AsyncClient, model: str, options: oai.PayloadOptions) -> None:
        self.args = args
        self.http = http
        self.model = model
        self.options = options
        self.url = args.base_url.rstrip("/") + endpoint_of(args)
        self.semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        self.records: list[RequestRecord] = []
        self.running_samples: list[tuple[float, float]] = []
        self.bar = None

    async def one_request(self, prompt: str | list[int], prompt_len: int, max_tokens: int,
                          conversation_id: int | None = None, turn: int | None = None,
                          structured_outputs: dict | None = None) -> RequestRecord:
        record = RequestRecord(prompt_len=prompt_len, expected_output_len=max_tokens,
                               conversation_id=conversation_id, turn=turn, structured_outputs=structured_outputs)
        payload = oai.build_payload(self.model, prompt, max_tokens, self.options, structured_outputs)
        if self.semaphore is None:
            await oai.send_completion(self.http, self.url, payload, record)
        else:
            async with self.semaphore:
                await oai.send_completion(self.http, self.url, payload, record)
        self.records.append(record)
        if self.bar is not None:
            self.bar.update(1)
        return record

    async def conversation(self, job: Conversation, conversation_id: int, tokenizer) -> None:
        history: list[tuple[str, str]] = []
        for turn, (user, max_tokens) in enumerate(zip(job.user_turns, job.output_lens, strict=True)):
            prompt = render_turn_prompt(history, user)
            prompt_len = job.prompt_lens[0] if turn == 0 and job.prompt_lens else \
                len(tokenizer.encode(prompt, add_special_tokens=False))
            multi = job.num_turns > 1
            record = await self.one_request(prompt, prompt_len, max_tokens,
                                            conversation_id if multi else None, turn if multi else None,
                                            job.structured_outputs if job.constrained else None)
            if not record.success:
                if self.bar is not None:  # the rest of the conversation is not sent
                    self.bar.update(job.num_turns - turn - 1)
                return
            history.append((user, record.generated_text))

    async def poll_running(self, t0: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            values = await oai.scrape_metrics(self.http, self.args.base_url.rstrip("/"))
            running = oai.running_requests(values)
            if running is None:
                return
            self.running_samples.append((time.perf_counter() - t0, running))
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.args.metrics_interval)
            except asyncio.TimeoutError:
                pass


def endpoint_of(args) -> str:
    """--endpoint, else the --backend's API path."""
    endpoint = getattr(args, "endpoint", None)
    return endpoint if endpoint else oai.BACKENDS[getattr(args, "backend", "openai")][1]


WARM_UP_CONSTRAINT = {"choice": ["yes", "no"]}
"""What the warm-up sends to check a server takes structured_outputs: a grammar none of the
datasets' requests share, so their compilations all fall in the measured part."""


async def warm_up(args, http: httpx.AsyncClient, model: str, tokenizer, maker_text: str,
                  constrained: bool = False) -> oai.PayloadOptions:
    """Send --num-warmups (at least one) requests, and one constrained request when `constrained`;
    return the payload options the server accepted."""
    url = args.base_url.rstrip("/") + endpoint_of(args)
    wanted = oai.PayloadOptions(ignore_eos=args.ignore_eos, temperature=args.temperature,
                                min_tokens=getattr(args, "send_min_tokens", False),
                                api=oai.BACKENDS[getattr(args, "backend", "openai")][0])
    last_error = ""
    for options in wanted.variants():
        record = RequestRecord(prompt_len=0, expected_output_len=8)
        await oai.send_completion(http, url, oai.build_payload(model, maker_text, 8, options), record)
        if record.success:
            for _ in range(args.num_warmups - 1):
                await oai.send_completion(http, url, oai.build_payload(model, maker_text, 8, options),
                                          RequestRecord(prompt_len=0, expected_output_len=8))
            if constrained:
                record = RequestRecord(prompt_len=0, expected_output_len=8)
                payload = oai.build_payload(model, maker_text, 8, options, WARM_UP_CONSTRAINT)
                await oai.send_completion(http, url, payload, record)
                if not record.success:
                    raise ValueError(f"warm-up request with structured_outputs to {url} failed: {record.error}")
            return options
        last_error = record.error
        if not last_error.startswith(("http 400", "http 422")):
            break  # not a refused extension: the server is down or broken
    raise ValueError(f"warm-up request to {url} failed: {last_error}")


async def run_serve_benchmark(args, jobs: list[Conversation] | None = None, tokenizer=None) -> dict:
    """Run the benchmark the flags describe; returns the result dict (also written/printed by main)."""
    slos = parse_goodput(args.goodput)
    percentiles = parse_percentiles(args.metric_percentiles)
    base_url = args.base_url.rstrip("/")
    if tokenizer is None:
        tokenizer = load_tokenizer_for_bench(args.tokenizer, args.model)
    if jobs is None:
        jobs = build_dataset(args, tokenizer)
    offsets = arrival_offsets(len(jobs), args.request_rate, args.burstiness, args.seed)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=oai.auth_headers()) as http:
        model = args.model or await oai.fetch_first_model(http, base_url)
        from kvtide.bench.datasets import PromptMaker

        warm_text = PromptMaker(tokenizer, np.random.default_rng(args.seed + 1)).text(
            min(64, max(1, jobs[0].prompt_lens[0] if jobs[0].prompt_lens else 16)))[0]
        options = await warm_up(args, http, model, tokenizer, warm_text, any(j.constrained for j in jobs))
        before = await oai.scrape_metrics(http, base_url)
        run = ServeRun(args, http, model, options)
        total_requests = sum(j.num_turns for j in jobs)
        if not args.disable_tqdm:
            from tqdm import tqdm

            run.bar = tqdm(total=total_requests, desc="requests", file=sys.stderr)
        t0 = time.perf_counter()
        stop = asyncio.Event()
        poller = asyncio.create_task(run.poll_running(t0, stop)) if before else None

        async def start_at(offset: float, job: Conversation, cid: int) -> None:
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await run.conversation(job, cid, tokenizer)

        await asyncio.gather(*(start_at(o, j, i) for i, (o, j) in enumerate(zip(offsets, jobs, strict=True))))
        t_end = time.perf_counter()
        stop.set()
        if poller is not None:
            await poller
        if run.bar is not None:
            run.bar.close()
        after = await oai.scrape_metrics(http, base_url)
    duration = (max(r.end_time for r in run.records) if run.records else t_end) - t0
    result = compute_serving_metrics(run.records, duration, percentiles, slos)
    result.update(oai.server_counter_deltas(before, after))
    if any(job.structured_outputs is not None for job in jobs):
        result["structured_output_ratio"] = getattr(args, "structured_output_ratio", 1.0)
        result["structured_output"] = structured_output_summary(run.records, before, after)
    result.update({
        "date": datetime.now().isoformat(timespec="seconds"), "base_url": base_url, "model": model,
        "endpoint": endpoint_of(args), "backend": getattr(args, "backend", "openai"), "dataset_name": args.dataset_name, "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed,
        "ignore_eos": options.ignore_eos, "usage_reported": options.include_usage,
        "min_tokens_sent": options.min_tokens,
        # The client's machine; its GEMM choices (from the disk cache) are the server's when local.
        "machine": machine_record(),
    })
    result["_records"] = run.records
    result["_t0"] = t0
    result["_running_samples"] = run.running_samples
    return result


def write_outputs(args, result: dict) -> None:
    """JSON (without the private fields, with per-request detail) and PNG plots."""
    records: list[RequestRecord] = result.pop("_records")
    t0: float = result.pop("_t0")
    running = result.pop("_running_samples")
    plot_dir = args.plot_dir
    if plot_dir is None and args.output_json:
        import os

        plot_dir = os.path.dirname(os.path.abspath(args.output_json))
    if plot_dir:
        from kvtide.bench.plots import plot_serving

        written = plot_serving(records, t0, running, plot_dir,
                               prefix=_stem(args.output_json) if args.output_json else "serve")
        result["plots"] = written
    if args.output_json:
        data = dict(result)
        data["requests"] = [{**r.to_dict(), "start_offset": r.start_time - t0,
                             "chunk_times": [t - r.start_time for t in r.chunk_times],
                             "start_time": None, "end_time": None} for r in records]
        with open(args.output_json, "w") as f:
            json.dump(_finite(data), f, indent=2)


def _stem(path: str) -> str:
    import os

    return os.path.splitext(os.path.basename(path))[0]


def _finite(obj):
    """NaN/inf -> None so the JSON is valid for strict parsers."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def main_serve(args) -> int:
    if args.backend not in oai.BACKENDS:  # the pooling backends
        from kvtide.bench.pooling import main_pooling

        return main_pooling(args)
    result = asyncio.run(run_serve_benchmark(args))
    write_outputs(args, result)
    print(format_report(result))
    print(format_machine(result["machine"]))
    if result.get("plots") == []:
        print("plots: matplotlib is not installed (pip install 'kvtide[plots]')", file=sys.stderr)
    return 0 if result["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtide bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_args(parser)
    return main_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
