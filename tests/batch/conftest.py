"""Fixtures for the batch tests: the tiny Llama of tests/conftest.py and `batch_server`, a
real `kvtide serve` with the batch routes. That server starts with the session when a collected test
asks for it, so it loads while the run-batch test runs its own engines; it is always stopped. The HF
reference runs on one intra-op thread (see torch_threads.py)."""

from __future__ import annotations

import os

import pytest
from batch_lines import MAX_BATCH_FILE_BYTES
from serve_helpers import pid_alive, start_server, wait_ready
from torch_threads import one_torch_thread


def pytest_configure(config):
    # The test files' group mark, known also to runs without pytest-xdist (-p no:xdist).
    config.addinivalue_line("markers", "xdist_group(name): pytest-xdist's worker group")


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():
    yield from one_torch_thread()


@pytest.fixture(scope="session", autouse=True)
def _batch_server_process(request, llama_dir, tmp_path_factory):
    wanted = any("batch_server" in getattr(item, "fixturenames", ()) for item in request.session.items)
    if not wanted:
        yield None
        return
    handle = start_server(llama_dir, "--batch-dir", str(tmp_path_factory.mktemp("batches")),
                          "--max-batch-file-bytes", str(MAX_BATCH_FILE_BYTES), "--max-batch-file-lines", "64",
                          "--scheduling-policy", "priority", "--max-batch-concurrency", "4", "--max-num-seqs", "8")
    try:
        yield handle
    finally:
        handle.stop()
        os.unlink(handle.log_path)


@pytest.fixture(scope="session")
def batch_server(_batch_server_process):
    handle = wait_ready(_batch_server_process)
    try:
        yield handle
    finally:
        assert handle.stop() == 0, handle.log()[-3000:]
        assert handle.engine_pid is not None and not pid_alive(handle.engine_pid)
