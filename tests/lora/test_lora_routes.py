"""The adapter routes and flags without an engine: who may load and unload, what --lora-modules
accepts, and that the engine's refusal of a bad adapter is a 400 with nothing taken."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvtide.engine.core_client import EngineGenerateError
from kvtide.server.api_server import build_app
from kvtide.server.metrics import ServerMetrics
from kvtide.server.openai.lora.modules import LoRAModules, parse_lora_modules, runtime_updating_allowed
from kvtide.server.state import ServerSettings, ServerState


class _StubEngine:
    is_dead = False

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def add_lora(self, request) -> float:
        if "bad" in request.lora_path:
            raise EngineGenerateError("ValueError: LoRA adapter 'x' has rank 64, above max_lora_rank=16")
        self.calls.append(("add", request.lora_name, request.lora_int_id))
        return 0.01

    async def remove_lora(self, lora_int_id: int) -> None:
        self.calls.append(("remove", lora_int_id))


def client(engine: _StubEngine, allowed: bool, serves_lora: bool = True) -> TestClient:
    state = ServerState(engine=engine, settings=ServerSettings(served_model_names=["m"]),
                        metrics=ServerMetrics("m"), loras=LoRAModules(["m"], allowed), engine_serves_lora=serves_lora)
    return TestClient(build_app(state))


def test_updates_refused_when_not_allowed_or_lora_is_off():
    engine = _StubEngine()
    refused = client(engine, allowed=False).post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
    assert refused.status_code == 404 and "allow-runtime-lora-updating" in refused.json()["error"]["message"]
    off = client(engine, allowed=True, serves_lora=False).post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert off.status_code == 400 and "--enable-lora" in off.json()["error"]["message"]
    assert engine.calls == []


def test_load_unload_and_the_engines_refusal():
    engine = _StubEngine()
    http = client(engine, allowed=True)
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/bad"})
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("LoRA adapter 'x' has rank 64")
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"}).status_code == 200
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"}).status_code == 400
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "m", "lora_path": "/a"}).status_code == 400
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"}).status_code == 200
    # Ids are never reused: the adapter loaded again has KV blocks of its own.
    assert engine.calls == [("add", "a", 2), ("remove", 2), ("add", "a", 3)]


def test_lora_modules_specs():
    specs = parse_lora_modules(["sql=/x/sql", '{"name": "chat", "path": "/x/chat", "base_model_name": "b"}'])
    assert [(s.name, s.path, s.base_model_name) for s in specs] == [("sql", "/x/sql", None), ("chat", "/x/chat", "b")]
    for bad, match in (("sql", "not name=path"), ("=/x", "not name=path"), ("{oops", "not valid JSON"),
                       ('{"name": "a"}', "name and path")):
        with pytest.raises(ValueError, match=match):
            parse_lora_modules([bad])
    with pytest.raises(ValueError, match="given twice"):
        parse_lora_modules(["a=/x", "a=/y"])


def test_runtime_updating_flag_and_environment(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert not runtime_updating_allowed(False) and runtime_updating_allowed(True)
    for value, allowed in (("True", True), ("1", True), ("0", False), ("false", False)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert runtime_updating_allowed(False) is allowed


def test_serve_refuses_lora_flags_without_enable_lora(llama_dir):
    from kvtide.cli import build_parser
    from kvtide.server.cli import run_serve

    args = build_parser("serve").parse_args(["serve", llama_dir, "--lora-modules", "a=/x"])
    with pytest.raises(ValueError, match="need --enable-lora"):
        run_serve(args)
