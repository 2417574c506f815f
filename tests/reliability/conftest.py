"""Fixtures of the reliability suite (issue 7): `kvtide serve` subprocesses on tiny checkpoints,
each started at session start so they load in parallel, and offline references (LLM on the same
checkpoint) to compare the server's greedy outputs with.

    fuzz_server      vocab-512 Llama (so 300 logit_bias entries fit), max_model_len 128
    load_server      small KV pool (preemptions), 32 seats; killed with -9 by its last test
    fault_server     KVTIDE_FAULT_INJECT: NaN logits for prompts holding token 257, raise on 258
    watchdog_server  --engine-timeout 2 (its engine core gets SIGSTOP)
    sigterm_server   --shutdown-timeout 1 and a slowed forward pass (SIGTERM under load)
    hostile_server   vocab-512 Llama, 4 MiB bodies, --trust-request-chat-template, --render-timeout 1

Every server is stopped in a finally; an engine core that outlives its server is killed and fails
the test that owned it.
"""

from __future__ import annotations

import json
import os

import pytest
from rel_helpers import (
    FIGURES,
    FUZZ_VOCAB,
    LOAD_KV_BLOCKS,
    NAN_TOKEN,
    RAISE_TOKEN,
    bytes_per_block,
    start,
    wait_ready,
)

from kvtide.sampling_params import SamplingParams

SERVERS = {
    "fuzz_server": dict(args=["--max-model-len", "128", "--max-num-seqs", "16"], vocab=FUZZ_VOCAB),
    "load_server": dict(args=["--max-model-len", "512", "--max-num-seqs", "32",
                              "--kv-cache-memory", str(LOAD_KV_BLOCKS * bytes_per_block())]),
    "fault_server": dict(args=["--max-model-len", "256", "--max-num-seqs", "8"],
                         env={"KVTIDE_FAULT_INJECT": f"nan_token={NAN_TOKEN},raise_token={RAISE_TOKEN}"}),
    "watchdog_server": dict(args=["--max-model-len", "512", "--max-num-seqs", "8", "--engine-timeout", "2"]),
    "sigterm_server": dict(args=["--max-model-len", "512", "--max-num-seqs", "8", "--shutdown-timeout", "1"],
                           env={"KVTIDE_FAULT_INJECT": "sleep_s=0.02"}),
    "hostile_server": dict(args=["--max-model-len", "512", "--max-num-seqs", "16", "--max-request-body", "4MiB",
                                 "--trust-request-chat-template", "--render-timeout", "1"], vocab=FUZZ_VOCAB),
}


@pytest.fixture(scope="session")
def fuzz_model_dir(checkpoint_factory) -> str:
    return checkpoint_factory("LlamaForCausalLM", vocab_size=FUZZ_VOCAB)


@pytest.fixture(scope="session")
def _rel_servers(request, llama_dir, fuzz_model_dir):
    wanted = {name for item in request.session.items for name in getattr(item, "fixturenames", ())
              if name in SERVERS}
    handles = {}
    try:
        for name, spec in SERVERS.items():
            if name in wanted:
                model = fuzz_model_dir if spec.get("vocab") else llama_dir
                handles[name] = start(model, *spec["args"], env=spec.get("env"))
        yield handles
    finally:
        for handle in handles.values():
            handle.stop()
            os.unlink(handle.log_path)


def _server(handles, name):
    return wait_ready(handles[name])


@pytest.fixture(scope="session")
def fuzz_server(_rel_servers):
    return _server(_rel_servers, "fuzz_server")


@pytest.fixture(scope="session")
def load_server(_rel_servers):
    return _server(_rel_servers, "load_server")


@pytest.fixture(scope="session")
def fault_server(_rel_servers):
    return _server(_rel_servers, "fault_server")


@pytest.fixture(scope="session")
def watchdog_server(_rel_servers):
    return _server(_rel_servers, "watchdog_server")


@pytest.fixture(scope="session")
def sigterm_server(_rel_servers):
    return _server(_rel_servers, "sigterm_server")


@pytest.fixture(scope="session")
def hostile_server(_rel_servers):
    """The default 4 MiB body limit (hostile bodies get past it) and --trust-request-chat-template."""
    return _server(_rel_servers, "hostile_server")


class OfflineReference:
    """Greedy outputs of LLM.generate on a checkpoint, each prompt run alone, cached."""

    def __init__(self, model_dir: str) -> None:
        from kvtide import LLM

        self.llm = LLM(model_dir, max_model_len=512, kv_cache_memory="32MiB", max_num_seqs=4)
        self._cache: dict[tuple, tuple[str, str | None, int]] = {}

    def greedy(self, prompt: str | list[int], max_tokens: int) -> tuple[str, str | None, int]:
        """(text, finish_reason, number of tokens) of `prompt` run alone, temperature 0."""
        key = (json.dumps(prompt), max_tokens)
        if key not in self._cache:
            item = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
            out = self.llm.generate(item, SamplingParams(temperature=0.0, max_tokens=max_tokens))[0].outputs[0]
            self._cache[key] = (out.text, out.finish_reason, len(out.token_ids))
        return self._cache[key]


@pytest.fixture(scope="session")
def reference(llama_dir) -> OfflineReference:
    return OfflineReference(llama_dir)


@pytest.fixture(scope="session")
def fuzz_reference(fuzz_model_dir) -> OfflineReference:
    return OfflineReference(fuzz_model_dir)


def pytest_sessionfinish(session):
    """Under pytest-xdist the summary is the controller's: the figures go to it (tests/conftest.py)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None and FIGURES:
        workeroutput["kvtide_figures"] = json.dumps(FIGURES)


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section("kvtide reliability figures")
        for name, value in FIGURES.items():
            terminalreporter.write_line(f"{name}: {json.dumps(value, sort_keys=True)}")
