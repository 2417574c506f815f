"""--api-keys-file puts kvtide.server.quotas' QuotaMiddleware in front of the router: unknown keys
get 401, a key over its requests_per_minute 429, and the per-key counters are in the router's
own /metrics."""

from __future__ import annotations

import json

import httpx
from router_helpers import MODEL_NAME, free_port, metric_value, start_router

from kvtide.cli import main

BODY = {"model": MODEL_NAME, "prompt": "quota", "max_tokens": 2, "temperature": 0.0}


def test_quota_file_limits_keys_at_the_router(backend_a, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "sk-team-a", "name": "team-a", "requests_per_minute": 2}]}))
    router = start_router("--backends", backend_a.base_url, "--api-keys-file", str(keys))
    try:
        assert httpx.post(router.url("/v1/completions"), json=BODY, timeout=30.0).status_code == 401
        auth = {"Authorization": "Bearer sk-team-a"}
        for _ in range(2):
            assert httpx.post(router.url("/v1/completions"), json=BODY, headers=auth, timeout=60.0).status_code == 200
        limited = httpx.post(router.url("/v1/completions"), json=BODY, headers=auth, timeout=30.0)
        assert limited.status_code == 429 and "Retry-After" in limited.headers
        assert limited.json()["error"]["code"] == "rate_limit_exceeded"
        assert httpx.get(router.url("/health"), timeout=10.0).status_code == 200
        metrics = router.metrics()
        assert metric_value(metrics, "kvtide:quota_requests_total", key_name="team-a", outcome="admitted") == 2
        assert metric_value(metrics, "kvtide_router_requests_total", backend=backend_a.base_url) == 2
        assert "sk-team-a" not in router.log()
    finally:
        router.stop()


def test_bad_quota_file_exits_2_before_listening(tmp_path, capsys):
    bad = tmp_path / "keys.json"
    bad.write_text("{not json")
    code = main(["router", "--backends", "http://127.0.0.1:9", "--api-keys-file", str(bad),
                 "--port", str(free_port())])
    assert code == 2
    assert "kvtide router: error:" in capsys.readouterr().err
