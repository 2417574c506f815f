"""Prometheus metrics, named like vLLM's with a `kvtide:` prefix.

Latencies are observed in the API process as outputs arrive (AsyncLLM calls the StatLogger
methods); engine gauges and counters (running, waiting, KV usage, preemptions, prefix cache) are
read from the engine core's SchedulerStats on every scrape.

Speculative decoding (vLLM's names): spec_decode_num_drafts, spec_decode_num_draft_tokens,
spec_decode_num_accepted_tokens and spec_decode_num_accepted_tokens_per_pos{position="i"}, counted
from the deltas of SchedulerStats.spec_decoding; the per-position family has one sample per draft
position once the engine reports speculation, none without it.

Structured output: structured_output_requests (constrained requests admitted), its grammar cache
hits, grammar_compile_seconds (a histogram of compilations), jump_forward_tokens (tokens appended
without a forward pass each) and invalid_requests (constraints refused with a 400: bad schema,
regex or grammar), from SchedulerStats.structured_output and the input processor.

Mixture-of-experts models: moe_expert_tokens{layer, expert} (assignments routed), moe_layer_tokens
and moe_dropped_tokens{layer} (skipped by --moe-capacity-factor), moe_expert_load_imbalance{layer}
(max/mean of the experts' counts) and its largest value, from SchedulerStats.expert_load.

Data parallelism (--data-parallel-size N): every series above is summed over the N engine cores
(counters from each replica's own deltas); data_parallel_requests{engine} (requests the balancer
sent each replica), data_parallel_prefix_affinity_requests{engine} (those a prefix match decided),
data_parallel_engine_requests{engine} (engine-core requests each holds now) and
data_parallel_engine_running / _waiting{engine} (its own scheduler's counts) show the split.

Per-key quotas (--api-keys-file, server/quotas.py registers them in this registry):
quota_requests_total{key_name, outcome} (admitted, rejected_requests, rejected_tokens,
rejected_concurrency; unauthorized under key_name "unknown"), quota_tokens_total{key_name} and
quota_inflight{key_name}, labelled by the key's name, never by the key.

Memory (worker/memory_budget.py, measured at startup): memory_bytes{kind} with kind weights_stored,
weights_held, packed_copies, kv_pool, runtime and resident, summed over data-parallel replicas.

KV blocks are reported in three gauges, so a cache that filled up is not mistaken for a leak:

    kv_cache_blocks_total = in_use (held by requests) + evictable (free, still holding a cached
                            prefix: reused on a hit, evicted LRU when room is needed) + empty
"""

from __future__ import annotations

import itertools
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily

from kvtide.engine.async_llm import FinishedRequestStats, IterationStats
from kvtide.engine.dp_client import merge_stats
from kvtide.engine.expert_load import imbalance
from kvtide.engine.messages import ITERATION_TOKEN_BUCKETS, SchedulerStats
from kvtide.spec_decode.metrics import difference

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                          0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

MAX_EXPERT_SERIES = 4096
MAX_LORA_SERIES = 32
"""Adapters with a series of their own in kvtide:lora_adapter_requests (bounded cardinality)."""
LORA_LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Per-(layer, expert) series of kvtide:moe_expert_tokens a model may have; beyond, per layer only."""

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """One registry per server (tests may run several in one process)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._labels = {"model_name": model_name}
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(f"kvtide:{name}", doc, labels, buckets=buckets, registry=r).labels(**self._labels)

        def gauge(name: str, doc: str):
            return Gauge(f"kvtide:{name}", doc, labels, registry=r).labels(**self._labels)

        def counter(name: str, doc: str):
            return Counter(f"kvtide:{name}", doc, labels, registry=r).labels(**self._labels)

        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Time from arrival to the first generated token.", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Time between consecutive token deliveries of a request.",
                                             _TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = histogram("request_time_per_output_token_seconds",
                                               "Mean time per output token after the first, per request.",
                                               _TOKEN_LATENCY_BUCKETS)
        self.e2e_latency = histogram("e2e_request_latency_seconds",
                                     "Time from arrival to the end of the request.", _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time a request waited before it was first scheduled.", _LATENCY_BUCKETS)
        self.num_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.pooling_requests = counter("pooling_requests", "Pooling requests (embeddings, classification, "
                                        "scores) finished; not counted as generation.")
        self.pooling_prompt_tokens = counter("pooling_prompt_tokens", "Prompt tokens of pooling requests "
                                             "(apart from prompt_tokens, which counts generation's).")
        self.preemptions = counter("num_preemptions", "Requests preempted by the scheduler.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prefix_cache_hit_rate = gauge("prefix_cache_hit_rate",
                                           "Prefix-cache hits / queries in tokens since start (0..1).")
        self.kv_blocks_in_use = gauge("kv_cache_blocks_in_use", "KV blocks held by live requests.")
        self.kv_blocks_evictable = gauge("kv_cache_blocks_evictable",
                                         "Free KV blocks that still hold a cached prefix (evicted only "
                                         "when room is needed).")
        self.kv_blocks_total = gauge("kv_cache_blocks_total", "KV blocks in the pool.")
        self.max_num_seqs = gauge("max_num_seqs", "Most requests in one step (--max-num-seqs), summed over replicas.")
        self.max_num_batched_tokens = gauge("max_num_batched_tokens",
                                            "Token budget of one step, summed over replicas.")
        self._iteration_tokens = _IterationTokens(model_name)
        r.register(self._iteration_tokens)
        self.kv_connector_hit_tokens = Counter(
            "kvtide:kv_connector_hit_tokens", "Prompt tokens a KV connector loaded instead of computing, by tier "
            "(cpu, redis, p2p).", ["model_name", "tier"], registry=r)
        self.kv_connector_saved_blocks = Counter(
            "kvtide:kv_connector_saved_blocks", "KV blocks a connector wrote to a tier.", ["model_name", "tier"],
            registry=r)
        self.kv_connector_corrupt_entries = counter(
            "kv_connector_corrupt_entries", "Tier entries found truncated, corrupted or foreign (recomputed).")
        self.kv_connector_rejected_entries = counter(
            "kv_connector_rejected_entries",
            "Tier entries not signed with the deployment's KV secret: unsigned or forged (recomputed).")
        self.kv_connector_transfer_failures = counter(
            "kv_connector_transfer_failures", "p2p pulls that failed or timed out (the prompt was computed).")
        self.kv_connector_staged_requests = counter(
            "kv_connector_staged_requests", "p2p: prompts a prefill instance staged for a decode instance.")
        self._finished = Counter("kvtide:request_success", "Finished requests, by finish reason.",
                                 ["model_name", "finished_reason"], registry=r)
        self.spec_num_drafts = counter("spec_decode_num_drafts", "Verification steps of requests that had drafts.")
        self.spec_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.")
        self.spec_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_accepted_per_pos = Counter("kvtide:spec_decode_num_accepted_tokens_per_pos",
                                              "Draft tokens accepted at each position of their draft.",
                                              ["model_name", "position"], registry=r)
        self.so_requests = counter("structured_output_requests", "Requests admitted with a structured output constraint.")
        self.so_cache_hits = counter("structured_output_grammar_cache_hits",
                                     "Constrained requests whose grammar was already compiled.")
        self.so_compile_seconds = histogram("structured_output_grammar_compile_seconds",
                                            "Time to compile a grammar against the vocabulary.", _LATENCY_BUCKETS)
        self.so_jump_forward_tokens = counter("structured_output_jump_forward_tokens",
                                              "Tokens appended without a forward pass each (forced by the grammar).")
        self.so_invalid = counter("structured_output_invalid_requests",
                                  "Requests refused because their schema, regex or grammar is invalid.")
        self.moe_expert_tokens = Counter("kvtide:moe_expert_tokens", "Token assignments routed to each expert of "
                                         "each sparse layer (series: at most MAX_EXPERT_SERIES layer x expert pairs).",
                                         ["model_name", "layer", "expert"], registry=r)
        self.moe_layer_tokens = Counter("kvtide:moe_layer_tokens", "Token assignments routed in each sparse layer.",
                                        ["model_name", "layer"], registry=r)
        self.moe_dropped_tokens = Counter("kvtide:moe_dropped_tokens", "Token assignments skipped by the capacity "
                                          "cap (--moe-capacity-factor) in each sparse layer.",
                                          ["model_name", "layer"], registry=r)
        self.moe_imbalance = Gauge("kvtide:moe_expert_load_imbalance", "Max over mean of the experts' assignments "
                                   "since start, per sparse layer (1: even).", ["model_name", "layer"], registry=r)
        self.moe_max_imbalance = gauge("moe_expert_load_imbalance_max",
                                       "The largest per-layer expert-load imbalance (max/mean) since start.")
        engine_labels = ["model_name", "engine"]
        self.dp_requests = Counter("kvtide:data_parallel_requests", "Requests routed to each data-parallel "
                                   "engine.", engine_labels, registry=r)
        self.dp_affinity_requests = Counter("kvtide:data_parallel_prefix_affinity_requests",
                                            "Requests routed to each data-parallel engine by a prefix match.",
                                            engine_labels, registry=r)
        self.dp_engine_requests = Gauge("kvtide:data_parallel_engine_requests", "Engine-core requests each "
                                        "data-parallel engine holds (waiting + running), as routed.",
                                        engine_labels, registry=r)
        # Not *num_requests_running: clients that sum every series ending so (kvtide bench) would
        # count the running requests twice.
        self.dp_running = Gauge("kvtide:data_parallel_engine_running", "Requests in each data-parallel "
                                "engine's running batch.", engine_labels, registry=r)
        self.dp_waiting = Gauge("kvtide:data_parallel_engine_waiting", "Requests waiting in each "
                                "data-parallel engine.", engine_labels, registry=r)
        # LoRA: vLLM's info gauge (its value the scrape's time), requests per adapter, load times.
        self.lora_info = Gauge("kvtide:lora_requests_info", "Running and waiting LoRA adapters (comma-separated "
                               "names) and max_lora; the value is the time of the report.",
                               ["running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=r)
        self.lora_adapter_requests = Gauge("kvtide:lora_adapter_requests", "Requests running or waiting per LoRA "
                                           f"adapter (the first {MAX_LORA_SERIES} adapters by name; the rest as "
                                           "'other').", ["model_name", "lora_name", "state"], registry=r)
        self.lora_load_seconds = histogram("lora_adapter_load_seconds", "Time to load a LoRA adapter from disk "
                                           "into host memory (read, check, convert).", LORA_LOAD_BUCKETS)
        self._lora_loads_seen = 0
        self.memory_bytes = Gauge("kvtide:memory_bytes", "Memory measured at startup, by kind: weights as stored "
                                  "in the checkpoint and as held, packed weight copies, the KV pool, the rest of "
                                  "the resident process (runtime) and the resident total.",
                                  ["model_name", "kind"], registry=r)
        self._dp_last: dict[int, tuple[int, int]] = {}
        self._so_last_compile: dict[int, int] = {}
        self._so_last_invalid = 0
        self._last_per_engine: list[SchedulerStats] = []

    # ---- StatLogger (called by AsyncLLM) --------------------------------------------------------
    def record_iteration(self, stats: IterationStats) -> None:
        for value in stats.time_to_first_tokens:
            self.time_to_first_token.observe(value)
        for value in stats.inter_token_latencies:
            self.inter_token_latency.observe(value)
        for value in stats.queue_times:
            self.queue_time.observe(value)
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.num_pooling_requests:
            self.pooling_requests.inc(stats.num_pooling_requests)
            self.pooling_prompt_tokens.inc(stats.num_pooling_prompt_tokens)

    def record_finished(self, stats: FinishedRequestStats) -> None:
        self._finished.labels(finished_reason=stats.finish_reason, **self._labels).inc()
        self.e2e_latency.observe(stats.e2e_latency)
        if stats.time_per_output_token is not None:
            self.time_per_output_token.observe(stats.time_per_output_token)

    # ---- scrape ------------------------------------------------------------------------------
    def update_from_engine(self, stats: SchedulerStats) -> None:
        self.update_from_engines([stats])

    def update_from_engines(self, per_engine: list[SchedulerStats]) -> None:
        """One scrape of every engine core's stats (one per data-parallel replica): gauges of
        their sum, counters advanced by what each engine's own counts gained."""
        if not per_engine:
            return
        stats = merge_stats(per_engine)
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.kv_blocks_in_use.set(stats.num_used_blocks)
        self.kv_blocks_evictable.set(stats.num_evictable_blocks)
        self.kv_blocks_total.set(stats.num_blocks)
        self.max_num_seqs.set(stats.max_num_seqs)
        self.max_num_batched_tokens.set(stats.max_num_batched_tokens)
        self._iteration_tokens.latest = stats.iteration_tokens
        queries = stats.prefix_cache_queries
        self.prefix_cache_hit_rate.set(stats.prefix_cache_hits / queries if queries else 0.0)
        if len(self._last_per_engine) != len(per_engine):
            self._last_per_engine = [SchedulerStats() for _ in per_engine]
        for engine, (new_stats, last) in enumerate(zip(per_engine, self._last_per_engine, strict=True)):
            for counter, new, old in (
                    (self.preemptions, new_stats.num_preemptions, last.num_preemptions),
                    (self.prefix_cache_queries, new_stats.prefix_cache_queries, last.prefix_cache_queries),
                    (self.prefix_cache_hits, new_stats.prefix_cache_hits, last.prefix_cache_hits)):
                if new > old:
                    counter.inc(new - old)
            self._update_spec_decoding(new_stats.spec_decoding, last.spec_decoding)
            self._update_structured_output(new_stats.structured_output, last.structured_output, engine)
            self._count_expert_load(new_stats.expert_load, last.expert_load)
            self._update_kv_connector(new_stats.kv_connector, last.kv_connector)
            if len(per_engine) > 1:
                self.dp_running.labels(engine=str(engine), **self._labels).set(new_stats.num_running)
                self.dp_waiting.labels(engine=str(engine), **self._labels).set(new_stats.num_waiting)
        self._set_expert_imbalance(stats.expert_load)
        self._update_lora(per_engine[0].lora)
        for kind, value in (stats.memory or {}).items():
            self.memory_bytes.labels(kind=kind, **self._labels).set(value)
        self._last_per_engine = list(per_engine)

    def _update_lora(self, lora: dict | None) -> None:
        if lora is None:
            return
        self.lora_info.clear()
        self.lora_info.labels(running_lora_adapters=",".join(sorted(lora["running"])),
                              waiting_lora_adapters=",".join(sorted(lora["waiting"])),
                              max_lora=str(lora["max_lora"])).set(time.time())
        self.lora_adapter_requests.clear()
        for state in ("running", "waiting"):
            counts = lora[state]
            names = sorted(counts)
            shown, rest = names[:MAX_LORA_SERIES], names[MAX_LORA_SERIES:]
            for name in shown:
                self.lora_adapter_requests.labels(lora_name=name, state=state, **self._labels).set(counts[name])
            if rest:
                self.lora_adapter_requests.labels(lora_name="other", state=state, **self._labels).set(
                    sum(counts[n] for n in rest))
        new = lora["num_loads"] - self._lora_loads_seen
        for seconds in lora["recent_load_seconds"][-new:] if new > 0 else []:
            self.lora_load_seconds.observe(seconds)
        self._lora_loads_seen = lora["num_loads"]

    def update_data_parallel(self, summaries: list[dict]) -> None:
        """The balancer's per-engine figures (AsyncLLM.engine_summaries); nothing with one engine."""
        for summary in summaries:
            engine = summary["engine"]
            labels = dict(engine=str(engine), **self._labels)
            before = self._dp_last.get(engine, (0, 0))
            now = (summary["requests"], summary["affinity_requests"])
            for counter, new, old in zip((self.dp_requests, self.dp_affinity_requests), now, before, strict=True):
                child = counter.labels(**labels)
                if new > old:
                    child.inc(new - old)
            self._dp_last[engine] = now
            self.dp_engine_requests.labels(**labels).set(summary["num_requests"])

    def _count_expert_load(self, new: dict | None, old: dict | None) -> None:
        """Add what each expert's count gained since the last scrape; per-expert series only while
        layers x experts stays within MAX_EXPERT_SERIES (a 256-expert, 58-layer model keeps its
        per-layer series)."""
        if new is None:
            return
        per_expert = len(new["layers"]) * len(new["tokens"][0]) <= MAX_EXPERT_SERIES
        for i, layer in enumerate(new["layers"]):
            label = str(layer)
            tokens, dropped = new["tokens"][i], new["dropped"][i]
            before = old["tokens"][i] if old is not None else [0] * len(tokens)
            before_dropped = old["dropped"][i] if old is not None else [0] * len(dropped)
            if per_expert:
                for expert, (n, m) in enumerate(zip(tokens, before, strict=True)):
                    child = self.moe_expert_tokens.labels(layer=label, expert=str(expert), **self._labels)
                    if n > m:
                        child.inc(n - m)
            gained = sum(tokens) - sum(before)
            layer_counter = self.moe_layer_tokens.labels(layer=label, **self._labels)
            if gained > 0:
                layer_counter.inc(gained)
            skipped = sum(dropped) - sum(before_dropped)
            dropped_counter = self.moe_dropped_tokens.labels(layer=label, **self._labels)
            if skipped > 0:
                dropped_counter.inc(skipped)

    def _set_expert_imbalance(self, load: dict | None) -> None:
        """Per layer max/mean of the experts' counts since start (over every engine)."""
        if load is None:
            return
        worst = 0.0
        for i, layer in enumerate(load["layers"]):
            value = imbalance(load["tokens"][i])
            if value is not None:
                self.moe_imbalance.labels(layer=str(layer), **self._labels).set(value)
                worst = max(worst, value)
        self.moe_max_imbalance.set(worst)

    def _update_structured_output(self, new: dict | None, old: dict | None, engine: int = 0) -> None:
        if new is None:
            return
        for counter, key in ((self.so_requests, "num_constrained_requests"), (self.so_cache_hits, "num_cache_hits"),
                             (self.so_jump_forward_tokens, "num_jump_forward_tokens")):
            gained = new[key] - (old[key] if old is not None else 0)
            if gained > 0:
                counter.inc(gained)
        last = self._so_last_compile.get(engine, 0)
        for number, seconds in new["compile_seconds"]:
            if number > last:
                self.so_compile_seconds.observe(seconds)
                last = number
        self._so_last_compile[engine] = last

    def record_invalid_structured_outputs(self, total: int) -> None:
        """The input processor's count of refused constraints so far."""
        if total > self._so_last_invalid:
            self.so_invalid.inc(total - self._so_last_invalid)
            self._so_last_invalid = total

    def _update_kv_connector(self, new: dict | None, old: dict | None) -> None:
        """Add what a KV connector's counters (disagg/base.py ConnectorStats) gained since the last scrape."""
        if new is None:
            return
        old = old or {}
        for family, key in ((self.kv_connector_hit_tokens, "hit_tokens"), (self.kv_connector_saved_blocks, "saved_blocks")):
            for tier, value in new[key].items():
                gained = value - old.get(key, {}).get(tier, 0)
                if gained > 0:
                    family.labels(tier=tier, **self._labels).inc(gained)
        for counter, key in ((self.kv_connector_corrupt_entries, "corrupt_entries"),
                             (self.kv_connector_rejected_entries, "rejected_entries"),
                             (self.kv_connector_transfer_failures, "transfer_failures"),
                             (self.kv_connector_staged_requests, "staged_requests")):
            gained = new[key] - old.get(key, 0)
            if gained > 0:
                counter.inc(gained)

    def _update_spec_decoding(self, new: dict | None, old: dict | None) -> None:
        """Add what the engine's speculative-decoding counters gained since the last scrape."""
        if new is None:
            return
        if old is not None and len(old["accepted_per_pos"]) != len(new["accepted_per_pos"]):
            old = None  # another K: a new run of counters
        delta = difference(new, old)
        for counter, key in ((self.spec_num_drafts, "num_drafts"), (self.spec_num_draft_tokens, "num_draft_tokens"),
                             (self.spec_num_accepted_tokens, "num_accepted_tokens")):
            if delta[key] > 0:
                counter.inc(delta[key])
        for position, count in enumerate(delta["accepted_per_pos"]):
            child = self._spec_accepted_per_pos.labels(position=str(position), **self._labels)
            if count > 0:
                child.inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _IterationTokens:
    """kvtide:iteration_tokens_total: a histogram of the tokens each engine step scheduled, kept by
    the engine core (SchedulerStats.iteration_tokens) and exported as its latest scrape."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.latest: dict | None = None

    def collect(self):
        family = HistogramMetricFamily("kvtide:iteration_tokens_total", "Tokens scheduled per engine step.",
                                       labels=["model_name"])
        if self.latest is not None:
            cumulative = list(itertools.accumulate(self.latest["counts"]))
            buckets = [(str(float(b)), c) for b, c in zip(ITERATION_TOKEN_BUCKETS, cumulative, strict=False)]
            family.add_metric([self.model_name], buckets + [("+Inf", cumulative[-1])], self.latest["sum"])
        yield family
