"""`bench compare` is fair to every engine: one engine runs at a time (the other workers are
stopped meanwhile), and each repeat sends fresh prompts (no prefix-cache hits from the last one)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import pytest

from kvtide.bench import compare, peers
from kvtide.bench.common import random_token_prompts


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_pause_stops_the_worker_process_group_and_resume_continues_it():
    worker = peers.PausableProcess()
    # a plain process with a child, in its own session like the engine workers and servers
    worker.proc = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"],
        start_new_session=True)
    try:
        time.sleep(0.5)
        children = subprocess.run(["pgrep", "-g", str(worker.proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 2  # the worker and its child: the whole group is paused
        worker.pause()
        time.sleep(0.2)
        assert {_state(int(pid)) for pid in children} == {"T"}
        worker.resume()
        time.sleep(0.2)
        assert "T" not in {_state(int(pid)) for pid in children}
    finally:
        peers._signal_group(worker.proc.pid, 9)
        worker.proc.wait()


class _FakeWorker:
    def __init__(self, name: str, events: list[str], fail: bool = False) -> None:
        self.name, self.events, self.fail = name, events, fail

    def pause(self) -> None:
        self.events.append(f"pause {self.name}")

    def resume(self) -> None:
        self.events.append(f"resume {self.name}")

    def run(self, workload: str, repeat: int, timeout_s: float) -> dict:
        self.events.append(f"run {self.name} {workload} {repeat}")
        if self.fail:
            raise RuntimeError("worker failed")
        return {"ok": True}


def test_run_alone_pauses_every_other_worker_around_the_run_even_when_it_fails():
    events: list[str] = []
    workers = {"a": _FakeWorker("a", events), "b": _FakeWorker("b", events), "c": _FakeWorker("c", events)}
    assert compare._run_alone(workers, "b", "throughput", 1, 10) == {"ok": True}  # type: ignore[arg-type]
    assert events == ["pause a", "pause c", "run b throughput 1", "resume a", "resume c"]
    events.clear()
    workers["a"].fail = True
    with pytest.raises(RuntimeError):
        compare._run_alone(workers, "a", "latency", 0, 10)  # type: ignore[arg-type]
    assert events == ["pause b", "pause c", "run a latency 0", "resume b", "resume c"]


def test_each_repeat_gets_fresh_prompts():
    parser = argparse.ArgumentParser()
    compare.add_compare_args(parser)
    args = parser.parse_args(["--repeats", "3", "--num-prompts", "4", "--input-len", "32", "--output-len", "8"])
    spec = compare.build_spec(args, "unused", {"vocab_size": 1000})
    rounds = spec["throughput"]["rounds"]
    assert len(rounds) == len(spec["latency"]["rounds"]) == 3
    assert rounds[0]["prompts"] == random_token_prompts(1000, 4, 32, 8, args.seed)[0]  # round 0: --seed's
    first_blocks = [{tuple(p[:16]) for p in r["prompts"]} for r in rounds]
    assert not (first_blocks[0] & first_blocks[1]) and not (first_blocks[1] & first_blocks[2])
    assert spec["latency"]["rounds"][0]["prompts"] != spec["latency"]["rounds"][1]["prompts"]
