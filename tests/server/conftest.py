"""Fixtures: real `kvtide serve` subprocesses on a tiny checkpoint.

`server` is shared by the tests/server session (startup costs seconds). `drain_server` and
`small_server` exist for lifecycle tests that drain or kill them. Every server the collected tests
ask for is started at once, so they load in parallel; each is stopped in a finally, and an
engine-core child that outlived its server fails the test (and is killed).
"""

from __future__ import annotations

import os

import pytest
from serve_helpers import API_KEY, pid_alive, start_server, wait_ready

LONG_MODEL_LEN = "2048"
# --max-num-seqs also bounds the CPU KV cache these servers allocate (max_num_seqs * max_model_len).
SERVER_FLAGS = {
    # Its /v1/responses keeps nothing (test_responses_api.py): one server fewer than a dedicated one.
    "server": ["--max-num-seqs", "40", "--enable-admin-api", "--disable-response-storage"],
    # Schedules each step while the one before runs: draining and aborts must hold there too.
    "drain_server": ["--max-model-len", LONG_MODEL_LEN, "--max-num-seqs", "4", "--shutdown-timeout", "120",
                     "--async-scheduling"],
    "small_server": ["--max-model-len", LONG_MODEL_LEN, "--max-num-seqs", "1", "--max-waiting-requests", "1"],
    # Tool calling and reasoning output (tests/server/test_tool_calling.py, test_reasoning_api.py).
    "tools_server": ["--max-num-seqs", "16", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                     "--reasoning-parser", "deepseek_r1", "--trust-request-chat-template"],
}


@pytest.fixture(scope="session")
def _server_processes(request, llama_dir):
    wanted = {name for item in request.session.items for name in getattr(item, "fixturenames", ())
              if name in SERVER_FLAGS}
    handles = {}
    try:
        for name in SERVER_FLAGS:
            if name in wanted:
                handles[name] = start_server(llama_dir, *SERVER_FLAGS[name])
        yield handles
    finally:
        for handle in handles.values():
            handle.stop()
            os.unlink(handle.log_path)


@pytest.fixture(scope="session")
def server(_server_processes):
    handle = wait_ready(_server_processes["server"])
    try:
        yield handle
    finally:
        code = handle.stop()
        assert code == 0, handle.log()[-3000:]
        assert handle.engine_pid is not None and not pid_alive(handle.engine_pid)


@pytest.fixture(scope="session")
def drain_server(_server_processes):
    return wait_ready(_server_processes["drain_server"])


@pytest.fixture(scope="session")
def small_server(_server_processes):
    return wait_ready(_server_processes["small_server"])


@pytest.fixture(scope="session")
def tools_server(_server_processes):
    return wait_ready(_server_processes["tools_server"])


@pytest.fixture(scope="session")
def tools_client(tools_server):
    import openai

    return openai.OpenAI(base_url=tools_server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=120.0)


@pytest.fixture(scope="session")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=120.0)


@pytest.fixture(scope="session")
def async_openai_client(server):
    import openai

    return openai.AsyncOpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=120.0)
