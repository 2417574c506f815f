"""The router's own Prometheus metrics (`kvtide_router_` prefix) in its own registry, so a process
that runs the router next to something else exports only these at GET /metrics.

    kvtide_router_requests_total{backend,status}     responses relayed (status "error": none came)
    kvtide_router_in_flight_requests{backend}        requests open on each backend now
    kvtide_router_retries_total{reason}              retries on another backend (connection_error,
                                                     draining, prefill_failed)
    kvtide_router_backend_healthy{backend}           1 while the backend takes new requests
    kvtide_router_routing_decisions_total{decision}  cache_aware: prefix_match or load
    kvtide_router_prefix_match_ratio                 cache_aware: matched share of each prompt
    kvtide_router_pd_prefill_seconds                 prefill/decode: the prefill request
    kvtide_router_pd_decode_ttft_seconds             prefill/decode: decode request to first byte
    kvtide_router_pd_prefill_fallbacks_total         prefill/decode: decoded without a prefill
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvtide_router_requests", "Responses relayed, by backend and HTTP status.",
                                ["backend", "status"], registry=r)
        self.in_flight = Gauge("kvtide_router_in_flight_requests", "Requests open on each backend.",
                               ["backend"], registry=r)
        self.retries = Counter("kvtide_router_retries", "Requests retried on another backend, by reason.",
                               ["reason"], registry=r)
        self.healthy = Gauge("kvtide_router_backend_healthy", "1 while the backend takes new requests.",
                             ["backend"], registry=r)
        self.decisions = Counter("kvtide_router_routing_decisions", "cache_aware choices: by prefix match or "
                                 "by load.", ["decision"], registry=r)
        self.match_ratio = Histogram("kvtide_router_prefix_match_ratio", "cache_aware: matched prefix share of "
                                     "each prompt on the best backend.", buckets=_RATIO_BUCKETS, registry=r)
        self.prefill_seconds = Histogram("kvtide_router_pd_prefill_seconds", "Prefill requests (max_tokens 1), "
                                         "seconds.", buckets=_SECONDS_BUCKETS, registry=r)
        self.decode_ttft_seconds = Histogram("kvtide_router_pd_decode_ttft_seconds", "Decode requests: seconds "
                                             "to the first byte.", buckets=_SECONDS_BUCKETS, registry=r)
        self.prefill_fallbacks = Counter("kvtide_router_pd_prefill_fallbacks", "Requests decoded without a "
                                         "prefill (every prefill backend failed).", registry=r)

    def set_backends(self, urls: list[str], healthy: dict[str, bool]) -> None:
        for url in urls:
            self.healthy.labels(backend=url).set(1 if healthy.get(url) else 0)
            self.in_flight.labels(backend=url).set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
