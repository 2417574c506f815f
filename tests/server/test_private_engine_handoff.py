"""What `kvtide serve` hands its engine-core process stays private: the engine args (which may hold
the KV secret) never appear on a command line, and the IPC sockets live in a 0700 directory of
this user, removed at shutdown."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile

import pytest
from serve_helpers import ADMIN_KEY, MAX_MODEL_LEN, MODEL_NAME, ServerHandle, free_port, log_dir, wait_ready

KV_SECRET = "kv-secret-never-on-argv-5f3a"

# The server reads its KV config from a file, as an operator's launcher would from a mounted secret:
# the secret reaches EngineArgs without being on the server's own command line.
LAUNCHER = """\
import sys
from kvtide.cli import main
with open(sys.argv[1]) as f:
    config = f.read()
sys.exit(main([*sys.argv[2:], "--kv-transfer-config", config]))
"""


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


@pytest.fixture(scope="module")
def secret_server(llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("handoff")
    launcher, config = folder / "launch.py", folder / "kv.json"
    launcher.write_text(LAUNCHER)
    config.write_text(json.dumps({"kv_connector": "p2p", "kv_role": "kv_producer", "kv_secret": KV_SECRET}))
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="kvtide-serve-", suffix=".log", dir=log_dir(), delete=False)
    env = {k: v for k, v in os.environ.items() if k not in ("KVTIDE_KV_SECRET", "KVTIDE_API_KEY")}
    proc = subprocess.Popen(
        [sys.executable, str(launcher), str(config), "serve", llama_dir, "--port", str(port), "--served-model-name",
         MODEL_NAME, "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "2", "--admin-api-key", ADMIN_KEY],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**env, "OMP_NUM_THREADS": "1"})
    log.close()
    handle = wait_ready(ServerHandle(proc, port, None, log.name, admin_key=ADMIN_KEY))
    try:
        yield handle
    finally:
        handle.stop()


def test_engine_args_with_a_secret_are_not_on_any_command_line(secret_server):
    engine_cmdline = _cmdline(secret_server.engine_pid)
    assert "--engine-args-file" in engine_cmdline and "--engine-args " not in engine_cmdline
    assert KV_SECRET not in engine_cmdline
    assert KV_SECRET not in _cmdline(secret_server.proc.pid)
    assert "kv_connector" not in engine_cmdline  # no part of the engine args at all


def test_ipc_sockets_lie_in_a_private_directory(secret_server):
    engine_cmdline = _cmdline(secret_server.engine_pid).split()
    paths = [engine_cmdline[engine_cmdline.index(flag) + 1].removeprefix("ipc://") for flag in ("--input", "--output")]
    directory = os.path.dirname(paths[0])
    assert os.path.dirname(paths[1]) == directory and directory != tempfile.gettempdir()
    info = os.stat(directory)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    # The sockets, and nothing else: the engine args file was read and deleted.
    assert sorted(os.listdir(directory)) == sorted(os.path.basename(p) for p in paths)
    assert all(stat.S_ISSOCK(os.stat(p).st_mode) for p in paths)
    assert secret_server.stop() == 0
    assert not os.path.exists(directory)
