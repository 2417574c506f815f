"""Fixtures: real `kvtide serve` backends on the tiny Llama, started together at session start (so
they load in parallel) and stopped in a finally.

    backend_a, backend_b   shared by most tests; never killed
    victim_kill            SIGKILLed by the retry test
    victim_drain           SIGTERMed (drains) by the drain test
"""

from __future__ import annotations

import os

import pytest
from router_helpers import BACKEND_FLAGS, start_server, wait_ready

# backend_a's steps take at least 3 ms (the fault injector's sleep): the client-gone test's 400-token
# requests then outlast the router's 0.25 s disconnect poll however fast the tiny model decodes.
BACKEND_ENV = {"backend_a": {"KVTIDE_FAULT_INJECT": "sleep_s=0.003"}}
BACKENDS = {
    "backend_a": BACKEND_FLAGS,
    "backend_b": BACKEND_FLAGS,
    "victim_kill": BACKEND_FLAGS,
    # Long enough a drain that the requests in flight finish inside it.
    "victim_drain": [*BACKEND_FLAGS, "--shutdown-timeout", "60"],
}


@pytest.fixture(scope="session")
def _router_backends(request, llama_dir):
    wanted = {name for item in request.session.items for name in getattr(item, "fixturenames", ())
              if name in BACKENDS}
    handles = {}
    try:
        for name in BACKENDS:
            if name in wanted:
                handles[name] = start_server(llama_dir, *BACKENDS[name], api_key=None, env=BACKEND_ENV.get(name))
        yield handles
    finally:
        for handle in handles.values():
            handle.stop()
            if os.path.exists(handle.log_path):
                os.unlink(handle.log_path)


@pytest.fixture(scope="session")
def backend_a(_router_backends):
    return wait_ready(_router_backends["backend_a"])


@pytest.fixture(scope="session")
def backend_b(_router_backends):
    return wait_ready(_router_backends["backend_b"])


@pytest.fixture(scope="session")
def victim_kill(_router_backends):
    return wait_ready(_router_backends["victim_kill"])


@pytest.fixture(scope="session")
def victim_drain(_router_backends):
    return wait_ready(_router_backends["victim_drain"])
