"""One streamed OpenAI request, timed chunk by chunk (/v1/completions, /v1/chat/completions or
/v1/responses, as `kvtide bench serve --backend` picks); and /metrics scraping.

A request succeeds only if the server answered 200, streamed at least one token (a chunk with text, or
an empty one before the end), gave a finish_reason and ended the stream with `data: [DONE]`. Everything else (HTTP errors, error objects inside the stream, a connection
dropped mid-stream, a stream that stops without [DONE]) is a failure with the reason kept in
`RequestRecord.error` as 'kind: detail'.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass

import httpx

from kvtide.bench.request_record import RequestRecord
from kvtide.bench.spec_figures import counter_difference, counters_from_prometheus, spec_decode_figures


@dataclass
class PayloadOptions:
    """Extensions some servers refuse; probed during warm-up and dropped when refused."""

    ignore_eos: bool = True
    include_usage: bool = True
    min_tokens: bool = False
    """Also send min_tokens = max_tokens, for servers that accept but ignore ignore_eos
    (llama-cpp-python's): EOS is then masked rather than ignored, so greedy tokens may differ."""
    temperature: float = 0.0
    api: str = "completions"
    """completions, chat (/v1/chat/completions) or responses (/v1/responses): the body and stream shape."""

    def variants(self) -> list[PayloadOptions]:
        """This, then every subset of its extensions, largest first, for the warm-up probe."""
        wanted = [name for name in ("include_usage", "ignore_eos", "min_tokens") if getattr(self, name)]
        out = []
        for keep in range(len(wanted), -1, -1):
            for kept in itertools.combinations(wanted, keep):
                out.append(PayloadOptions(**{name: name in kept for name in wanted}, temperature=self.temperature,
                                          api=self.api))
        return out


def auth_headers() -> dict[str, str]:
    """`Authorization: Bearer $OPENAI_API_KEY` when the variable is set (as vLLM's benchmark client
    sends it), for a server started with --api-key."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


BACKENDS = {"openai": ("completions", "/v1/completions"), "openai-chat": ("chat", "/v1/chat/completions"),
            "openai-responses": ("responses", "/v1/responses")}
"""--backend (vLLM's names) -> (api, default endpoint)."""


def build_payload(model: str, prompt: str | list[int], max_tokens: int, options: PayloadOptions,
                  structured_outputs: dict | None = None) -> dict:
    """A streamed completion request. A constrained one (structured_outputs, vLLM's object) sends
    max_tokens only: ignore_eos or min_tokens would hold it past the end its grammar reaches."""
    payload: dict = {"model": model, "max_tokens": max_tokens, "temperature": options.temperature, "stream": True}
    if options.api == "completions":
        payload["prompt"] = prompt
    else:
        if not isinstance(prompt, str):
            raise ValueError(f"--backend openai-{options.api} sends text: this dataset's prompts are token ids")
        if options.api == "chat":
            payload["messages"] = [{"role": "user", "content": prompt}]
            payload["max_completion_tokens"] = payload.pop("max_tokens")
        else:
            payload["input"] = prompt
            payload["max_output_tokens"] = payload.pop("max_tokens")
    if structured_outputs is not None:
        payload["structured_outputs"] = structured_outputs
    elif options.ignore_eos:
        payload["ignore_eos"] = True
    if options.min_tokens and structured_outputs is None:
        payload["min_tokens"] = max_tokens
    if options.include_usage and options.api != "responses":  # a response's usage comes with its end
        payload["stream_options"] = {"include_usage": True}
    return payload


async def send_completion(client: httpx.AsyncClient, url: str, payload: dict, record: RequestRecord) -> None:
    """POST `payload` (stream=True) to `url`, filling `record` in place. Never raises for server faults."""
    record.start_time = time.perf_counter()
    saw_done = False
    text_parts: list[str] = []
    usage_completion: int | None = None
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")[:300]
                record.error = f"http {response.status_code}: {body}"
                return
            async for line in response.aiter_lines():
                now = time.perf_counter()
                line = line.strip()
                if not line or line.startswith(":"):
                    continue
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    saw_done = True
                    break
                chunk = json.loads(data)
                if "input" in payload:  # the Responses API: typed events, no [DONE]
                    kind = chunk.get("type", "")
                    if kind in ("error", "response.failed"):
                        record.error = f"stream error: {str(chunk)[:300]}"
                        return
                    if kind.endswith(("output_text.delta", "reasoning_text.delta", "arguments.delta")):
                        record.chunk_times.append(now)
                        text_parts.append(chunk.get("delta") or "")
                    elif kind in ("response.completed", "response.incomplete"):
                        response_body = chunk.get("response") or {}
                        usage = response_body.get("usage") or {}
                        usage_completion = usage.get("output_tokens", usage_completion)
                        if usage.get("input_tokens"):
                            record.prompt_len = int(usage["input_tokens"])
                        record.finish_reason = "stop" if kind == "response.completed" else "length"
                        saw_done = True
                        break
                    continue
                if "error" in chunk:
                    record.error = f"stream error: {str(chunk['error'])[:300]}"
                    return
                usage = chunk.get("usage")
                if usage:
                    usage_completion = usage.get("completion_tokens", usage_completion)
                    if usage.get("prompt_tokens"):
                        record.prompt_len = int(usage["prompt_tokens"])
                choices = chunk.get("choices") or []
                if _carries_token(choices):
                    record.chunk_times.append(now)
                for choice in choices:
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                    delta = choice.get("delta") or {}
                    text_parts.append(choice.get("text") or delta.get("content") or "")
    except (httpx.HTTPError, OSError) as e:
        record.error = f"dropped: {type(e).__name__}: {e}"[:300]
        return
    except (json.JSONDecodeError, AttributeError, TypeError) as e:
        record.error = f"bad stream: {type(e).__name__}: {e}"[:300]
        return
    finally:
        record.end_time = time.perf_counter()
    record.generated_text = "".join(text_parts)
    record.output_len = int(usage_completion) if usage_completion is not None else len(record.chunk_times)
    if not saw_done:
        record.error = "no [DONE]: the stream ended early"
    elif not record.chunk_times:
        record.error = "no tokens: the stream carried no token"
    elif record.finish_reason is None:  # e.g. llama-cpp-python's server cutting a stream for a new request
        record.error = "no finish_reason: the stream was cut short"
    else:
        record.success = True


def _carries_token(choices: list[dict]) -> bool:
    """A chunk marks a token when it carries text, or when it is an empty chunk before the end (the
    server produced a token whose text is held back, e.g. half of a UTF-8 character). An empty chunk
    that only says finish_reason is the end, not a token; so is a chat chunk that only opens the
    message (its role)."""
    for choice in choices:
        delta = choice.get("delta")
        if delta is not None:
            if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls") or \
                    (choice.get("finish_reason") is None and "role" not in delta):
                return True
        elif choice.get("text") or choice.get("finish_reason") is None:
            return True
    return False


async def fetch_first_model(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    data = response.json().get("data") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model NAME")
    return data[0]["id"]


# ---- /metrics -------------------------------------------------------------------------------------
# Counter names differ by server; any family whose name ends in one of these is summed.
_PREFIX_HITS = ("prefix_cache_hits",)
_PREFIX_QUERIES = ("prefix_cache_queries",)
_PREEMPTIONS = ("num_preemptions", "preemptions")
_RUNNING = ("num_requests_running",)
KNOWN_PREFIXES = ("kvtide:", "vllm:")


async def scrape_metrics(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """Sample name -> value (summed over labels) for the kvtide:/vllm: families, or None when the
    server has no Prometheus /metrics. Samples with a `position` label are also kept one per position,
    as 'NAME{position="i"}'."""
    try:
        response = await client.get(f"{base_url}/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_prometheus(response.text)


def parse_prometheus(text: str) -> dict[str, float] | None:
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith(KNOWN_PREFIXES):
                    values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
                    if "position" in sample.labels:  # speculative decoding's per-position counters
                        key = f'{sample.name}{{position="{sample.labels["position"]}"}}'
                        values[key] = values.get(key, 0.0) + float(sample.value)
    except ValueError:
        return None
    return values or None


def _pick(values: dict[str, float], endings: tuple[str, ...]) -> float | None:
    found = [v for name, v in values.items()
             if any(name.endswith(e) or name.endswith(e + "_total") for e in endings)]
    return sum(found) if found else None


def running_requests(values: dict[str, float] | None) -> float | None:
    return _pick(values, _RUNNING) if values else None


def server_counter_deltas(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """Prefix-cache hit rate, preemptions and speculative-decoding figures during the run, from
    counters scraped before and after."""
    out: dict = {"prefix_cache_hit_rate": None, "num_preemptions": None, "spec_decode": None,
                 "server_metrics": after is not None}
    if not before or not after:
        return out
    spec = counter_difference(counters_from_prometheus(after), counters_from_prometheus(before))
    if spec is not None:
        out["spec_decode"] = spec_decode_figures(spec, len(spec["accepted_per_pos"]))
    hits = [_pick(v, _PREFIX_HITS) for v in (before, after)]
    queries = [_pick(v, _PREFIX_QUERIES) for v in (before, after)]
    if None not in hits and None not in queries:
        dq = queries[1] - queries[0]  # type: ignore[operator]
        dh = hits[1] - hits[0]  # type: ignore[operator]
        out["prefix_cache_queried_tokens"] = dq
        out["prefix_cache_hit_tokens"] = dh
        out["prefix_cache_hit_rate"] = dh / dq if dq > 0 else 0.0
    preempt = [_pick(v, _PREEMPTIONS) for v in (before, after)]
    if None not in preempt:
        out["num_preemptions"] = int(preempt[1] - preempt[0])  # type: ignore[operator]
    return out
