"""Grammars compile off the engine loop: a constrained request waits in the queue (not the batch)
while its grammar compiles, the others keep running, and a second request with the same
constraint finds the compiled grammar in the cache."""

from __future__ import annotations

import threading

from kvtide.config import CacheConfig, SchedulerConfig
from kvtide.engine.request import EngineCoreRequest, Request
from kvtide.models.demo import build_byte_tokenizer
from kvtide.sampling_params import SamplingParams, StructuredOutputsParams
from kvtide.scheduler.scheduler import Scheduler
from kvtide.structured_output.manager import StructuredOutputManager


def make_request(request_id: str, constraint: StructuredOutputsParams | None) -> Request:
    params = SamplingParams(max_tokens=8, structured_outputs=constraint)
    return Request(EngineCoreRequest(request_id, [5, 6, 7], params, eos_token_ids=[1]))


def test_a_request_waits_in_the_queue_while_its_grammar_compiles():
    gate = threading.Event()
    tokenizer = build_byte_tokenizer()

    def slow_tokenizer():
        assert gate.wait(30)
        return tokenizer

    manager = StructuredOutputManager(slow_tokenizer, len(tokenizer))
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(num_blocks=64, block_size=16), 256,
                          structured_output=manager)
    constraint = StructuredOutputsParams(regex="[0-9]{3}")
    scheduler.add_request(make_request("constrained", constraint))
    scheduler.add_request(make_request("plain", None))
    first = scheduler.schedule()
    assert set(first.num_scheduled_tokens) == {"plain"}
    assert [r.request_id for r in scheduler.waiting] == ["constrained"]
    assert first.grammar is None  # no constrained row: the runner pays nothing
    assert scheduler.has_compiling_requests()

    gate.set()
    manager.wait_for_compilation(30)
    second = scheduler.schedule()
    assert "constrained" in second.num_scheduled_tokens
    assert set(second.grammar.grammars) == {"constrained"}

    scheduler.add_request(make_request("same-constraint", constraint))
    assert manager.stats.num_cache_hits == 1 and manager.stats.num_compiled == 1
    manager.shutdown()


def test_a_grammar_that_fails_to_compile_ends_only_its_request():
    tokenizer = build_byte_tokenizer()
    manager = StructuredOutputManager(lambda: tokenizer, len(tokenizer))
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(num_blocks=64, block_size=16), 256,
                          structured_output=manager)
    # the frontend parses constraints first; a grammar the compiler still refuses ends its request
    bad = make_request("bad", StructuredOutputsParams(grammar="root ::= undefined_rule"))
    scheduler.add_request(bad)
    scheduler.add_request(make_request("plain", None))
    manager.wait_for_compilation(30)
    step = scheduler.schedule()
    assert set(step.num_scheduled_tokens) == {"plain"}
    outputs = scheduler.update_from_output(step, _sampled(step))
    failed = [o for o in outputs if o.request_id == "bad"]
    assert failed and failed[0].finish_reason == "abort" and "not defined" in failed[0].error
    assert "bad" not in scheduler.requests
    manager.shutdown()


def _sampled(step):
    from kvtide.scheduler.output import ModelRunnerOutput

    return ModelRunnerOutput(sampled_token_ids={r: 10 for r in step.sampling_req_ids})
