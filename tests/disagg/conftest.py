"""A real redis-server per session, on 127.0.0.1 at a free port, in a temporary directory; and the
deployment KV secret its entries are signed with ($KVTIDE_KV_SECRET, unless the caller set one)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest
import redis
from serve_helpers import free_port


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is not installed (.ci/run installs the redis-server package)"
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(workdir),
                             "--save", "", "--appendonly", "no", "--maxmemory", "512mb",
                             "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise
            time.sleep(0.05)
    client.close()
    secret_set = "KVTIDE_KV_SECRET" not in os.environ
    if secret_set:
        os.environ["KVTIDE_KV_SECRET"] = "disagg-tests-kv-secret"
    yield url
    if secret_set:
        os.environ.pop("KVTIDE_KV_SECRET", None)
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
