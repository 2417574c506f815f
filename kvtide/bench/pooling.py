"""`kvtide bench serve --backend openai-embeddings | rerank`: load a pooling server.

    kvtide bench serve --backend openai-embeddings --base-url URL --num-prompts 256 \\
        --random-input-len 272 --random-range-ratio 0.88 --max-concurrency 32     # 32..512 tokens
    kvtide bench serve --backend rerank --base-url URL --num-prompts 20 --rerank-documents 100

openai-embeddings: one POST /v1/embeddings per prompt of the dataset (`--embedding-batch-size` texts
per request). rerank: each prompt is a query, scored against `--rerank-documents` documents from the
dataset in one POST /v1/rerank. Arrivals, --max-concurrency and the dataset flags are serve's. The
report: requests, sequences and input tokens per second (tokens from the responses' usage) and
request latency percentiles.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from datetime import datetime

import httpx
import numpy as np

from kvtide.bench import client as oai
from kvtide.bench.common import machine_record

POOLING_BACKENDS = ("openai-embeddings", "rerank")


async def run_pooling_benchmark(args, texts: list[str] | None = None) -> dict:
    """Run the pooling load the flags describe; returns the result dict."""
    from kvtide.bench.datasets import build_dataset, load_tokenizer_for_bench

    if texts is None:
        tokenizer = load_tokenizer_for_bench(args.tokenizer, args.model)
        texts = [job.user_turns[0] for job in build_dataset(args, tokenizer)]
    rerank = args.backend == "rerank"
    batch = max(1, getattr(args, "embedding_batch_size", 1))
    num_docs = max(1, getattr(args, "rerank_documents", 100))
    if rerank:
        bodies = [{"query": texts[i], "documents": [texts[(i + 1 + j) % len(texts)] for j in range(num_docs)]}
                  for i in range(len(texts))]
        path = "/v1/rerank"
    else:
        bodies = [{"input": texts[i:i + batch]} for i in range(0, len(texts), batch)]
        path = "/v1/embeddings"
    base_url = args.base_url.rstrip("/")
    offsets = _arrival_offsets(len(bodies), args.request_rate, args.burstiness, args.seed)
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    latencies: list[float] = []
    errors: list[str] = []
    tokens = 0
    sequences = 0
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as http:
        model = args.model or await oai.fetch_first_model(http, base_url)
        warm = await http.post(base_url + path, json={**bodies[0], "model": model})
        if warm.status_code != 200:
            raise ValueError(f"warm-up request to {base_url + path} failed: http {warm.status_code}: {warm.text[:300]}")
        t0 = time.perf_counter()

        async def send(offset: float, body: dict) -> None:
            nonlocal tokens, sequences
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if semaphore is not None:
                await semaphore.acquire()
            start = time.perf_counter()
            try:
                response = await http.post(base_url + path, json={**body, "model": model})
                if response.status_code != 200:
                    errors.append(f"http {response.status_code}: {response.text[:200]}")
                    return
                usage = response.json().get("usage") or {}
                tokens += int(usage.get("prompt_tokens") or usage.get("total_tokens") or 0)
                sequences += len(body["documents"]) if rerank else len(body["input"])
                latencies.append(time.perf_counter() - start)
            except (httpx.HTTPError, OSError, ValueError) as e:
                errors.append(f"{type(e).__name__}: {e}"[:200])
            finally:
                if semaphore is not None:
                    semaphore.release()

        await asyncio.gather(*(send(o, b) for o, b in zip(offsets, bodies, strict=True)))
        duration = time.perf_counter() - t0
    lat = np.array(latencies) * 1000 if latencies else np.array([math.nan])
    return {"backend": args.backend, "date": datetime.now().isoformat(timespec="seconds"), "base_url": base_url,
            "model": model, "endpoint": path, "completed": len(latencies), "failed": len(errors),
            "errors": errors[:10], "duration_s": duration, "request_throughput": len(latencies) / duration,
            "sequence_throughput": sequences / duration, "input_token_throughput": tokens / duration,
            "total_input_tokens": tokens, "mean_latency_ms": float(np.mean(lat)),
            "median_latency_ms": float(np.median(lat)), "p99_latency_ms": float(np.percentile(lat, 99)),
            "machine": machine_record()}


def _arrival_offsets(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Start times as serve's: gamma intervals of mean 1/rate (shape `burstiness`); inf: all at once."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    if math.isinf(request_rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), size=num)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def format_pooling_report(result: dict) -> str:
    lines = [f"{'=' * 16} Pooling Benchmark Result ({result['backend']}) {'=' * 16}"]
    for label, key, fmt in [("Successful requests", "completed", "{}"), ("Failed requests", "failed", "{}"),
                            ("Duration (s)", "duration_s", "{:.2f}"),
                            ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
                            ("Sequence throughput (seq/s)", "sequence_throughput", "{:.2f}"),
                            ("Input token throughput (tok/s)", "input_token_throughput", "{:.1f}"),
                            ("Mean latency (ms)", "mean_latency_ms", "{:.2f}"),
                            ("Median latency (ms)", "median_latency_ms", "{:.2f}"),
                            ("P99 latency (ms)", "p99_latency_ms", "{:.2f}")]:
        lines.append(f"{label:<40}{fmt.format(result[key]):>14}")
    return "\n".join(lines)


def main_pooling(args) -> int:
    import json

    result = asyncio.run(run_pooling_benchmark(args))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    print(format_pooling_report(result))
    if result["errors"]:
        print("first errors: " + "; ".join(result["errors"][:3]), file=sys.stderr)
    return 0 if result["completed"] and not result["failed"] else 1
