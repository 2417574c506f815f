"""--admin-api-key: /internal/* exists only with it and answers only to it; the admin routes take it
when it is set; no client key (--api-key, a --api-keys-file key) opens them."""

from __future__ import annotations

import argparse
import json

import httpx
from fastapi.testclient import TestClient
from serve_helpers import free_port

from kvtide.server.api_server import build_app
from kvtide.server.metrics import ServerMetrics
from kvtide.server.quotas import parse_api_keys
from kvtide.server.state import ServerSettings, ServerState

ADMIN = "sk-admin-789"
CLIENT = "sk-client-123"
QUOTA_KEY = "sk-quota-456"


class _StubEngine:
    is_dead = False
    checks = 0
    resets = 0

    async def check_integrity(self) -> None:
        self.checks += 1

    async def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True


def _client(engine: _StubEngine, **settings) -> TestClient:
    state = ServerState(engine=engine, settings=ServerSettings(served_model_names=["m"], **settings),
                        metrics=ServerMetrics("m"))
    return TestClient(build_app(state))


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_internal_routes_are_off_without_an_admin_key():
    engine = _StubEngine()
    client = _client(engine, api_key=CLIENT)
    for path in ("/internal/check_integrity", "/internal/stats"):
        method = client.post if path.endswith("integrity") else client.get
        r = method(path, headers=_bearer(CLIENT))
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert engine.checks == 0
    open_client = _client(engine)  # no key at all: still off
    assert open_client.post("/internal/check_integrity").status_code == 404


def test_only_the_admin_key_opens_internal_and_admin_routes():
    engine = _StubEngine()
    client = _client(engine, api_key=CLIENT, admin_api_key=ADMIN, enable_admin_api=True)
    for path in ("/internal/check_integrity", "/reset_prefix_cache"):
        for headers in ({}, _bearer(ADMIN + "x"), _bearer(ADMIN[:-1]), {"x-api-key": "nope"}):
            r = client.post(path, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
        r = client.post(path, headers=_bearer(CLIENT))  # a client key: known, but not allowed here
        assert r.status_code == 403, path
        error = r.json()["error"]
        assert error["code"] == "permission_denied" and "--admin-api-key" in error["message"]
    assert engine.checks == engine.resets == 0
    assert client.post("/internal/check_integrity", headers=_bearer(ADMIN)).json() == {"ok": True}
    assert client.post("/reset_prefix_cache", headers={"x-api-key": ADMIN}).json() == {"reset": True}
    assert engine.checks == engine.resets == 1
    # The admin key is no client key.
    assert client.get("/v1/models", headers=_bearer(ADMIN)).status_code == 401


def test_quota_keys_never_reach_internal_routes():
    engine = _StubEngine()
    keys = parse_api_keys({"keys": [{"key": QUOTA_KEY, "name": "team", "requests_per_minute": 1}]})
    client = _client(engine, api_keys=keys, admin_api_key=ADMIN)
    r = client.post("/internal/check_integrity", headers=_bearer(QUOTA_KEY))
    assert r.status_code == 403 and engine.checks == 0
    for _ in range(3):  # the admin key is not a quota key: neither refused (401) nor limited (429)
        assert client.post("/internal/check_integrity", headers=_bearer(ADMIN)).status_code == 200
    assert engine.checks == 3


def test_flag():
    from kvtide.server import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    assert parser.parse_args(["serve", "demo"]).admin_api_key is None
    assert parser.parse_args(["serve", "demo", "--admin-api-key", ADMIN]).admin_api_key == ADMIN


def test_admin_key_of_the_keys_file_exits_2(tmp_path, capsys):
    from kvtide.cli import main

    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": QUOTA_KEY}]}))
    assert main(["serve", "demo", "--port", str(free_port()), "--api-keys-file", str(path),
                 "--admin-api-key", QUOTA_KEY]) == 2
    err = capsys.readouterr().err
    assert "--admin-api-key is a key of --api-keys-file" in err and QUOTA_KEY not in err


def test_real_server_internal_stats_needs_the_admin_key(server):
    """The session server (tests/server/conftest.py) has --api-key and --admin-api-key."""
    assert server.admin_key and server.stats()["engine_core_pid"] == server.engine_pid
    if server.admin_key != server.api_key:
        r = httpx.get(server.url("/internal/stats"), headers=server.headers, timeout=30.0)
        assert r.status_code == 403
    r = httpx.get(server.url("/internal/stats"), headers=_bearer("sk-nobody"), timeout=30.0)
    assert r.status_code == 401
    assert httpx.get(server.url("/internal/stats"), timeout=30.0).status_code == 401
