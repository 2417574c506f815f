"""Startup failures (issue 7, item 7): `kvtide serve` exits non-zero within seconds, its last line
naming the cause and the fix, and no traceback anywhere in its output.

All cases start at once (each is a fresh interpreter that imports torch: in parallel they cost
about what one does).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
from checkpoint_edits import set_architecture
from rel_helpers import FIGURES, bytes_per_block, free_port

EXIT_WITHIN_S = 90.0
"""Generous for a shared 2-core CI machine; the measured times go to the figures."""


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def _corrupt_weights(model: str) -> None:
    path = os.path.join(model, "model.safetensors")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 3])


def _remove_tokenizer(model: str) -> None:
    for name in os.listdir(model):
        if name.startswith(("tokenizer", "special_tokens")):
            os.unlink(os.path.join(model, name))


def _unknown_architecture(model: str) -> None:
    set_architecture(model, "FooBarForCausalLM")


# name -> (how to break a copy of the checkpoint, extra flags, words the last line must hold)
CASES = {
    "corrupt weights": (_corrupt_weights, [], ["model.safetensors", "corrupt", "download"]),
    "missing tokenizer": (_remove_tokenizer, [], ["tokenizer", "--tokenizer"]),
    "unknown architecture": (_unknown_architecture, [], ["FooBarForCausalLM", "not supported", "LlamaForCausalLM"]),
    "max_model_len beyond the KV cache": (None, ["--max-model-len", "1024", "--kv-cache-memory",
                                                 str(8 * bytes_per_block())], ["max_model_len", "kv_cache_memory"]),
    "port in use": (None, [], ["already in use", "--port"]),
}


@pytest.fixture(scope="module")
def outcomes(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("startup")
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    busy_port = blocker.getsockname()[1]
    procs = {}
    try:
        for i, (name, (breaker, flags, _)) in enumerate(CASES.items()):
            model = llama_dir
            if breaker is not None:
                model = _copy(llama_dir, str(root / f"case{i}"))
                breaker(model)
            port = busy_port if name == "port in use" else free_port()
            env = dict(os.environ, OMP_NUM_THREADS="1", KVTIDE_LOG_LEVEL="INFO")
            env.pop("KVTIDE_FAULT_INJECT", None)
            args = [sys.executable, "-m", "kvtide.cli", "serve", model, "--port", str(port), *flags]
            log = root / f"case{i}.log"
            with open(log, "w") as out:
                proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            procs[name] = (proc, time.monotonic(), log)
        results: dict = {}
        deadline = time.monotonic() + EXIT_WITHIN_S + 30
        while len(results) < len(procs) and time.monotonic() < deadline:
            for name, (proc, started, log) in procs.items():
                if name not in results and proc.poll() is not None:
                    results[name] = (proc.returncode, time.monotonic() - started, log.read_text(errors="replace"))
            time.sleep(0.05)
        for name, (proc, started, log) in procs.items():
            if name not in results:
                proc.kill()
                proc.wait()
                results[name] = (None, time.monotonic() - started, log.read_text(errors="replace"))
        yield results
    finally:
        blocker.close()
        for proc, _, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("name", list(CASES))
def test_exits_with_one_clean_line(outcomes, name):
    code, seconds, output = outcomes[name]
    FIGURES.setdefault("startup_failures_s", {})[name] = round(seconds, 1)
    lines = [line for line in output.splitlines() if line.strip()]
    assert code not in (0, None), output[-3000:]
    assert seconds < EXIT_WITHIN_S, output[-3000:]
    assert "Traceback" not in output, output[-5000:]
    last = lines[-1]
    assert last.startswith("kvtide serve: error: "), output[-3000:]
    assert sum(line.startswith("kvtide serve: error:") for line in lines) == 1
    for word in CASES[name][2]:
        assert word in last, last
