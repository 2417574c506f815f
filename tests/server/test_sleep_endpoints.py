"""Sleep mode over HTTP (--enable-sleep-mode): /sleep, /wake_up, /is_sleeping and
/update_weights_from_disk on a real server; the API answers 503 with Retry-After while asleep,
/health stays 200, waking gives the same greedy text, new weights give the new checkpoint's HF
text, and without the flag the routes do not exist."""

from __future__ import annotations

import os
import sys

import httpx
import pytest
from serve_helpers import MODEL_NAME, launch_server

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "models"))
from hf_reference import hf_greedy, hf_model_and_tokenizer  # noqa: E402

PROMPT = "The weather in Paris is"
MAX_TOKENS = 10


def _complete(server) -> str:
    r = httpx.post(server.url("/v1/completions"), headers=server.headers, timeout=60,
                   json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _hf_text(model_dir: str) -> str:
    _, tokenizer = hf_model_and_tokenizer(model_dir)
    return tokenizer.decode(hf_greedy(model_dir, PROMPT, MAX_TOKENS).token_ids)


@pytest.fixture(scope="module")
def second_checkpoint(checkpoint_factory) -> str:
    return checkpoint_factory(seed=1)


@pytest.fixture(scope="module")
def sleepy_server(llama_dir):
    handle = launch_server(llama_dir, "--enable-sleep-mode", "--kv-cache-memory", "16MiB")
    yield handle
    handle.stop()


def test_sleep_wake_and_new_weights_over_http(sleepy_server, llama_dir, second_checkpoint):
    server = sleepy_server
    before = _complete(server)
    assert before == _hf_text(llama_dir)
    admin = server.admin_headers
    r = httpx.post(server.url("/sleep"), params={"level": 2}, headers=admin, timeout=60)
    assert r.status_code == 200 and r.json() == {"is_sleeping": True, "level": 2}
    assert httpx.get(server.url("/is_sleeping"), headers=admin).json() == {"is_sleeping": True}
    asleep = httpx.post(server.url("/v1/completions"), headers=server.headers,
                        json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2})
    assert asleep.status_code == 503 and asleep.headers["Retry-After"]
    assert "asleep" in asleep.json()["error"]["message"]
    assert httpx.get(server.url("/health")).status_code == 200
    assert httpx.post(server.url("/wake_up"), headers=admin, timeout=120).status_code == 200
    assert httpx.get(server.url("/is_sleeping"), headers=admin).json() == {"is_sleeping": False}
    assert _complete(server) == before

    r = httpx.post(server.url("/update_weights_from_disk"), headers=admin, timeout=120,
                   json={"model_path": second_checkpoint})
    assert r.status_code == 200 and r.json()["success"] and r.json()["weight_version"] == 1
    assert _complete(server) == _hf_text(second_checkpoint) != before


def test_bad_calls_are_refused(sleepy_server, tmp_path):
    server = sleepy_server
    admin = server.admin_headers
    assert httpx.post(server.url("/sleep"), params={"level": 5}, headers=admin).status_code == 400
    assert httpx.post(server.url("/wake_up"), headers=admin).status_code == 400  # awake
    r = httpx.post(server.url("/update_weights_from_disk"), headers=admin, json={"model_path": str(tmp_path)})
    assert r.status_code == 400
    assert httpx.post(server.url("/update_weights_from_disk"), headers=admin, json={}).status_code in (400, 422)
    assert httpx.post(server.url("/sleep"), headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_without_the_flag_there_are_no_sleep_routes(server):
    """The suite's shared server runs without --enable-sleep-mode."""
    for path in ("/sleep", "/wake_up", "/update_weights_from_disk"):
        assert httpx.post(server.url(path), headers=server.admin_headers).status_code == 404
