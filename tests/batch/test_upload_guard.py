"""POST /v1/files through the guard middleware (a stub engine: no model): multipart only there and
within --max-batch-file-bytes rather than --max-request-body, still behind the Origin and key
checks; every other POST stays JSON-only; stored files are this user's alone."""

from __future__ import annotations

import os
import stat

import pytest

from kvtide.server.openai.batches.settings import BatchSettings

# One worker runs this folder: its conftest starts the batch server once, at the folder's first test.
pytestmark = pytest.mark.xdist_group("batch")

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}\n'
KEY = {"authorization": "Bearer k"}


class _StubEngine:
    is_dead = False


@pytest.fixture
def app_client(tmp_path):
    from fastapi.testclient import TestClient

    from kvtide.server.api_server import build_app
    from kvtide.server.metrics import ServerMetrics
    from kvtide.server.state import ServerSettings, ServerState

    settings = ServerSettings(served_model_names=["m"], api_key="k", max_request_body=1024,
                              batch=BatchSettings(directory=str(tmp_path / "store"), max_file_bytes=4096))
    state = ServerState(engine=_StubEngine(), settings=settings, metrics=ServerMetrics("m"))
    with TestClient(build_app(state), base_url="http://127.0.0.1:8000") as client:
        yield client


def _upload(client, data: bytes, purpose: str = "batch", headers: dict | None = None):
    return client.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": purpose},
                       headers={**KEY, **(headers or {})})


def test_upload_over_the_json_body_limit(app_client, tmp_path):
    data = LINE * 30  # over --max-request-body (1024), within the file limit (4096)
    r = _upload(app_client, data)
    assert r.status_code == 200, r.text
    file_id = r.json()["id"]
    assert app_client.get(f"/v1/files/{file_id}/content", headers=KEY).content == data
    store = tmp_path / "store"
    assert stat.S_IMODE(os.stat(store / "files").st_mode) == 0o700
    for name in os.listdir(store / "files"):
        assert stat.S_IMODE(os.stat(store / "files" / name).st_mode) == 0o600


def test_upload_refusals(app_client):
    assert _upload(app_client, LINE * 200).json()["error"]["code"] == "file_too_large"  # past the slack
    assert _upload(app_client, LINE * 50).json()["error"]["code"] == "file_too_large"  # within it
    assert _upload(app_client, LINE, headers={"authorization": "Bearer wrong"}).status_code == 401
    assert _upload(app_client, LINE, headers={"origin": "https://evil.example"}).status_code == 403
    r = app_client.post("/v1/files", json={"purpose": "batch"}, headers=KEY)
    assert r.status_code == 415 and "multipart/form-data" in r.json()["error"]["message"]
    r = app_client.post("/v1/files", data={"purpose": "batch"}, files={"other": ("x", b"1")}, headers=KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    # Every other route stays JSON only.
    r = app_client.post("/v1/completions", files={"file": ("in.jsonl", LINE)}, headers=KEY)
    assert r.status_code == 415
    r = app_client.post("/v1/batches", json={"input_file_id": "file-" + "0" * 24, "endpoint": "/v1/completions"},
                        headers=KEY)
    assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found"


def test_serve_flags():
    from kvtide.cli import build_parser
    from kvtide.server.openai.batches.settings import batch_settings_from_args

    def settings(*flags: str) -> BatchSettings:
        return batch_settings_from_args(build_parser("serve").parse_args(["serve", "demo", *flags]))

    assert settings() == BatchSettings()
    got = settings("--batch-dir", "/srv/b", "--max-batch-file-bytes", "2MiB", "--max-batch-file-lines", "9",
                   "--max-batch-concurrency", "3")
    assert got == BatchSettings(directory="/srv/b", max_file_bytes=2 * 1024 * 1024, max_file_lines=9, max_concurrency=3)
    for bad in (["--max-batch-concurrency", "0"], ["--max-batch-file-lines", "0"], ["--max-batch-file-bytes", "lots"]):
        with pytest.raises(ValueError, match=bad[0]):
            settings(*bad)


def test_one_server_per_batch_dir(tmp_path):
    from fastapi.testclient import TestClient

    from kvtide.server.api_server import build_app
    from kvtide.server.metrics import ServerMetrics
    from kvtide.server.state import ServerSettings, ServerState

    def client():
        settings = ServerSettings(served_model_names=["m"], api_key="k",
                                  batch=BatchSettings(directory=str(tmp_path / "shared")))
        return TestClient(build_app(ServerState(engine=_StubEngine(), settings=settings, metrics=ServerMetrics("m"))),
                          base_url="http://127.0.0.1:8000")

    with client() as first, client() as second:
        assert first.get("/v1/files", headers=KEY).status_code == 200
        r = second.get("/v1/files", headers=KEY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "batch_dir_in_use"
        assert str(os.getpid()) in r.json()["error"]["message"]
