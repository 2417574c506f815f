"""RouterState: the backends, pools, policies, metrics and HTTP clients one router process shares
between its request handlers and its health loop. Every change of a backend's health or load goes
through here, so the metrics always say what the policies see."""

from __future__ import annotations

import logging

import httpx

from kvtide.router.backends import Backend, BackendPool
from kvtide.router.config import HEALTH_CHECK_TIMEOUT_S, RouterSettings
from kvtide.router.metrics import RouterMetrics
from kvtide.router.policies import Policy, make_policy

logger = logging.getLogger("kvtide.router")


class RouterState:
    def __init__(self, settings: RouterSettings, metrics: RouterMetrics | None = None) -> None:
        settings.check()
        self.settings = settings
        self.metrics = metrics or RouterMetrics()
        self.backends = {url: Backend(url) for url in settings.all_backends}

        def pool_policy(name: str, urls: list[str]) -> Policy:
            pool = BackendPool(name, [self.backends[u] for u in urls])
            return make_policy(settings.policy, pool, settings.cache_threshold, settings.balance_threshold)

        if settings.disaggregated:
            self.prefill_policy: Policy | None = pool_policy("prefill", settings.prefill)
            self.policy = pool_policy("decode", settings.decode_pool)
        else:
            self.prefill_policy = None
            self.policy = pool_policy("backends", settings.backends)
        self.metrics.set_backends(list(self.backends), {})
        # No connection limit: the backends bound their own concurrency (and answer 429/503).
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(settings.request_timeout, connect=10.0), limits=limits,
                                      trust_env=False)
        self.health_http = httpx.AsyncClient(timeout=HEALTH_CHECK_TIMEOUT_S, trust_env=False)

    async def aclose(self) -> None:
        await self.http.aclose()
        await self.health_http.aclose()

    # ---- health ---------------------------------------------------------------------------------
    def admit(self, backend: Backend) -> None:
        if not backend.healthy:
            logger.info("backend %s is healthy: taking requests", backend.url)
        backend.admit()
        self.metrics.healthy.labels(backend=backend.url).set(1)

    def eject(self, backend: Backend, reason: str) -> None:
        if backend.healthy:
            logger.warning("backend %s ejected: %s", backend.url, reason)
        backend.eject(reason)
        self.metrics.healthy.labels(backend=backend.url).set(0)

    def serving_pool_healthy(self) -> bool:
        """Whether a generation request can be served: a backend (decode backend with prefill/decode,
        as decode alone can still compute the prompt) takes requests."""
        return self.policy.pool.any_healthy()

    # ---- load -----------------------------------------------------------------------------------
    def begin(self, backend: Backend) -> None:
        backend.in_flight += 1
        self.metrics.in_flight.labels(backend=backend.url).set(backend.in_flight)

    def end(self, backend: Backend, status: int | str) -> None:
        backend.in_flight -= 1
        self.metrics.in_flight.labels(backend=backend.url).set(backend.in_flight)
        self.metrics.requests.labels(backend=backend.url, status=str(status)).inc()
