"""`kvtide run-batch`: a 200-line file of good and bad lines, killed halfway and resumed.

Good lines' answers equal Hugging Face's greedy ones for the same prompt; bad lines get an error
record each and never stop the run; the resumed run answers exactly the lines the killed one had
not, in input order, after dropping the line the kill cut short.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from batch_lines import ENGINE_FLAGS, check_record, make_batch

# One worker runs this folder: its conftest starts the batch server once, at the folder's first test.
pytestmark = pytest.mark.xdist_group("batch")

KILL_AFTER_LINES = 40


def _run_batch_cmd(model_dir: str, input_path: str, output_path: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvtide.cli", "run-batch", "-i", input_path, "-o", output_path,
            "--model", model_dir, *ENGINE_FLAGS, *extra]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", KVTIDE_LOG_LEVEL="WARNING")


def _num_lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return f.read().count(b"\n")


def test_run_batch_killed_and_resumed(llama_dir, tmp_path):
    lines, expected = make_batch(llama_dir)
    input_path, output_path = str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")
    with open(input_path, "w") as f:
        f.write("\n".join(lines) + "\n\n")  # a trailing blank line is no request

    # 1. One line at a time, so the kill lands mid-file; killed with its engine core (its session).
    proc = subprocess.Popen(_run_batch_cmd(llama_dir, input_path, output_path, "--max-concurrent-lines", "1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while _num_lines(output_path) < KILL_AFTER_LINES and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
    num_before = _num_lines(output_path)
    assert KILL_AFTER_LINES <= num_before < len(lines), (num_before, stderr.decode()[-3000:])
    with open(output_path, "ab") as f:
        f.write(b'{"id": "batch_req_cut", "custom_id": "req-1')  # a line the kill cut short
    with open(output_path, "rb") as f:
        before = f.read().rsplit(b"\n", 1)[0] + b"\n"

    # 2. Resumed: appends the rest, the cut line dropped; a progress bar on stderr.
    done = subprocess.run(_run_batch_cmd(llama_dir, input_path, output_path, "--resume"), capture_output=True,
                          env=_env(), timeout=180)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert "Batch lines" in done.stderr.decode() and f"{num_before} already done" in done.stderr.decode()
    with open(output_path, "rb") as f:
        after = f.read()
    assert after.startswith(before)
    records = [json.loads(line) for line in after.splitlines()]

    # Every line once, in input order (bad lines without a custom_id too); then each as it must be.
    assert len(records) == len(lines)
    assert [r["custom_id"] for r in records] == [want.custom_id for want in expected]
    counts = collections.Counter(r["custom_id"] for r in records)
    assert counts["req-000"] == 3 and counts[None] == 4
    assert all(n == 1 for cid, n in counts.items() if cid not in ("req-000", None))
    for record, want in zip(records, expected, strict=True):
        check_record(llama_dir, record, want)
