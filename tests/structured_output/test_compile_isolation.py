"""Grammar compilation cannot hurt other requests: each compile runs in a compiler process under a
time and a memory limit (--structured-outputs-config compile_timeout_s / compile_memory_limit),
a failing one ends only its own request, a compile nobody waits for is stopped, the cache is
bounded in bytes, and JSON whitespace runs are bounded (max_whitespace_cnt) so a model that
likes whitespace still closes its objects.

Driven through a real engine core on the tiny byte-vocabulary Llama, with real compiler
processes, and constraints within the size limits on one (sampling_params.py) that still compile
slowly or hugely against that vocabulary."""

from __future__ import annotations

import json
import os
import time

import jsonschema
import pytest

from kvtide import LLM, SamplingParams
from kvtide.engine.request import EngineCoreRequest
from kvtide.sampling_params import StructuredOutputsParams

TIMEOUT_S = 3.0
CONFIG = {"compile_timeout_s": TIMEOUT_S, "compile_memory_limit": "16MiB", "cache_bytes": "96KiB",
          "compile_workers": 2}


def slow_schema(tag: str = "") -> StructuredOutputsParams:
    """A 24 KB schema whose string pattern of 4000 optional letters compiles for about a minute
    in a few MB here."""
    return StructuredOutputsParams(json={"type": "string", "pattern": f"^{tag}" + "[a-z]?" * 4000 + "$"})


def huge_schema() -> StructuredOutputsParams:
    """A 150 KB enum that takes ~50 MB to compile here, within a second."""
    return StructuredOutputsParams(json={"enum": [f"choice number {i} xyzzy" for i in range(5000)]})


def constrained(constraint: StructuredOutputsParams, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=constraint)


def add(core, request_id: str, params: SamplingParams) -> None:
    core.add_request(EngineCoreRequest(request_id, [5, 6, 7, 8], params, eos_token_ids=[1]))


def run_until_done(core, request_ids: set[str], limit_s: float = 60.0) -> dict:
    """Step the core until these requests finish: request id -> (final output, seconds taken)."""
    start = time.monotonic()
    done: dict = {}
    while set(done) != request_ids:
        assert time.monotonic() - start < limit_s, f"still running after {limit_s} s: {request_ids - set(done)}"
        for out in core.step():
            if out.finished and out.request_id in request_ids:
                done[out.request_id] = (out, time.monotonic() - start)
    return done


def busy_pid(core, limit_s: float = 10.0) -> int:
    """Step until a compiler process holds a job; its pid."""
    pool = core.structured_output.pool
    start = time.monotonic()
    while not any(w.job is not None for w in pool._workers):
        assert time.monotonic() - start < limit_s
        core.step()
        time.sleep(0.01)
    return next(w.process.pid for w in pool._workers if w.job is not None)


@pytest.fixture(scope="module")
def llm(llama_dir):
    """An engine with small compile limits and two compiler processes started."""
    llm = LLM(llama_dir, device="cpu", dtype="float32", max_model_len=512, kv_cache_memory="32MiB",
              structured_outputs_config=CONFIG)
    core = llm.engine.core
    for i in range(2):  # start both processes (seconds each) before timing anything
        add(core, f"warm-{i}", constrained(StructuredOutputsParams(regex=f"w{i}[0-9]")))
    run_until_done(core, {"warm-0", "warm-1"}, limit_s=120)
    assert len(core.structured_output.pool.worker_pids()) == 2
    yield llm
    llm.shutdown()


def test_a_compile_past_the_time_limit_ends_only_its_request(llm):
    core = llm.engine.core
    manager = core.structured_output
    add(core, "slow", constrained(slow_schema()))
    busy_pid(core)
    compiled_before = manager.stats.num_compiled
    add(core, "simple", constrained(StructuredOutputsParams(regex="[0-9]{4}"), max_tokens=2))
    while manager.stats.num_compiled == compiled_before:  # compiles beside the slow one, not behind it
        assert manager.stats.num_compile_timeouts == 0, "the simple grammar waited for the slow one"
        core.step()
    done = run_until_done(core, {"slow", "simple"})
    assert done["simple"][0].error is None and done["simple"][0].finish_reason in ("stop", "length")
    slow, slow_s = done["slow"]
    assert slow.finish_reason == "abort" and slow.error_status == 408
    assert "took too long to compile" in slow.error and "compile_timeout_s" in slow.error
    assert slow_s < TIMEOUT_S + 10
    assert manager.stats.num_compile_timeouts == 1
    assert not core.has_unfinished_requests()


def test_aborting_every_request_waiting_on_a_compile_stops_it(llm):
    core = llm.engine.core
    stats = core.structured_output.stats
    pool = core.structured_output.pool
    pids_before = set(pool.worker_pids())
    for request_id in ("first", "second"):  # two requests, one compile
        add(core, request_id, constrained(slow_schema(tag="x?")))
    start = time.monotonic()
    pid = busy_pid(core)
    core.abort_requests(["first"])
    time.sleep(0.2)
    assert pid in pool.worker_pids() and stats.num_compiles_cancelled == 0  # "second" still waits
    core.abort_requests(["second"])
    while pid in pool.worker_pids():
        assert time.monotonic() - start < TIMEOUT_S, "the compile was not stopped before its time limit"
        time.sleep(0.01)
    assert stats.num_compiles_cancelled == 1 and stats.num_compile_timeouts <= 1  # (test a's)
    assert not _alive(pid)
    assert len(set(pool.worker_pids()) - pids_before) == 1  # its successor, started at once
    add(core, "after", constrained(StructuredOutputsParams(regex="[a-f]{3}")))
    assert run_until_done(core, {"after"})["after"][0].error is None
    assert not core.has_unfinished_requests()


def test_a_compile_past_the_memory_limit_ends_only_its_request(llm):
    core = llm.engine.core
    pool = core.structured_output.pool
    errors_before = core.structured_output.stats.num_compile_errors
    start = time.monotonic()
    while len(pool.worker_pids()) < 2:  # earlier tests' replacements are up (the huge compile may
        assert time.monotonic() - start < 60  # fail faster than a poll could see it running)
        core.step()
        time.sleep(0.01)
    add(core, "huge", constrained(huge_schema()))
    add(core, "simple", constrained(StructuredOutputsParams(regex="[0-9]{4}")))
    done = run_until_done(core, {"huge", "simple"})
    huge, huge_s = done["huge"]
    assert huge.finish_reason == "abort" and huge.error_status == 400
    assert "compile memory limit" in huge.error and "compile_memory_limit" in huge.error
    assert huge_s < TIMEOUT_S  # the memory limit, not the time limit, ended it
    assert done["simple"][0].error is None
    # The compiler that ran out of memory either died (and was replaced) or refused the job itself:
    # either way the pool is whole again.
    assert all(_alive(pid) for pid in pool.worker_pids()) and len(pool.worker_pids()) >= 1
    add(core, "next", constrained(StructuredOutputsParams(regex="[a-f]{3}")))
    assert run_until_done(core, {"next"})["next"][0].error is None
    assert core.structured_output.stats.num_compile_errors == errors_before + 1


def test_the_grammar_cache_is_bounded_in_bytes(llm):
    core = llm.engine.core
    manager = core.structured_output

    def choices(n: int, tag: str) -> StructuredOutputsParams:  # ~0.3 KB of grammar per choice here
        return StructuredOutputsParams(choice=[f"choice number {i} {tag}" for i in range(n)])

    for i in range(8):
        add(core, f"g{i}", constrained(choices(60 + 10 * i, f"t{i}")))
        run_until_done(core, {f"g{i}"})
        assert 0 < manager.stats.cache_bytes <= 96 * 1024
    hits = manager.stats.num_cache_hits
    add(core, "g0-again", constrained(choices(60, "t0")))  # the oldest was dropped
    add(core, "g7-again", constrained(choices(130, "t7")))  # the newest is kept
    run_until_done(core, {"g0-again", "g7-again"})
    assert manager.stats.num_cache_hits == hits + 1


WHITESPACE_SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"]}


def test_whitespace_runs_are_bounded_so_json_closes(llm):
    """A model that strongly prefers whitespace (a logit bias on ' ', '\\n', '\\t', '\\r') at
    temperature 1: with unbounded whitespace every sample fills max_tokens with it; bounded by
    default (max_whitespace_cnt 16: at most 5 runs of 16 here, 80 + ~20 tokens), each closes
    its object well within max_tokens and validates."""
    tokenizer = llm.get_tokenizer()
    bias = {tokenizer.encode(c, add_special_tokens=False)[0]: 6.0 for c in (" ", "\n", "\t", "\r")}
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=160, logit_bias=bias,
                             structured_outputs=StructuredOutputsParams(json=WHITESPACE_SCHEMA))
              for seed in range(6)]
    outputs = [o.outputs[0] for o in llm.generate([f"Colour {seed}:" for seed in range(6)], params)]
    for output in outputs:
        assert output.finish_reason == "stop", (output.finish_reason, output.text)
        jsonschema.validate(json.loads(output.text), WHITESPACE_SCHEMA)
    assert all(sum(ch.isspace() for ch in o.text) >= 16 for o in outputs)  # the bias did bite


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
