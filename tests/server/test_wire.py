"""The API <-> engine-core wire format and the server's small helpers, without a server."""

from __future__ import annotations

import asyncio

import pytest

from kvtide.engine import serialization
from kvtide.engine.messages import EngineCoreOutput
from kvtide.engine.request import EngineCoreRequest
from kvtide.sampling_params import SamplingParams
from kvtide.server.errors import _param_of, from_value_error
from kvtide.server.openai.common import merge_streams, resolve_max_tokens


def test_request_round_trip_keeps_every_sampling_field():
    params = SamplingParams(n=2, temperature=0.5, top_k=5, stop=["x", "yz"], stop_token_ids=[7],
                            logit_bias={3: -1.5}, seed=11, logprobs=2, max_tokens=9, min_tokens=1)
    params.all_stop_token_ids = {1, 7}
    request = EngineCoreRequest("r1", [0, 5, 6], params, eos_token_ids=[1], arrival_time=12.5, priority=3)
    if hasattr(request, "fork_of"):
        request.fork_of = "r0"
    wire = serialization.decode(serialization.encode(["add", [serialization.request_to_wire(request)]]))
    back = serialization.request_from_wire(wire[1][0])
    assert back.request_id == "r1" and back.prompt_token_ids == [0, 5, 6]
    assert back.eos_token_ids == [1] and back.arrival_time == 12.5 and back.priority == 3
    assert back == request
    assert back.sampling_params == params
    assert back.sampling_params.all_stop_token_ids == {1, 7}
    assert back.sampling_params.logit_bias == {3: -1.5}


def test_output_round_trip():
    out = EngineCoreOutput("r", [4, 5], finish_reason="stop", stop_reason=5,
                           new_logprobs=[(-0.1, 1, [4], [-0.1]), (-0.2, 2, [9], [-0.05])], num_cached_tokens=16)
    wire = serialization.decode(serialization.encode(["outputs", [out], {}]))
    back = serialization.output_from_wire(wire[1][0])
    assert back.request_id == "r" and back.new_token_ids == [4, 5] and back.finished
    assert [tuple(x) for x in back.new_logprobs] == out.new_logprobs


def test_malformed_message_is_refused():
    with pytest.raises(ValueError):
        serialization.decode(serialization.encode({"not": "a list"}))


def test_wire_params_are_validated_again():
    wire = serialization.params_to_wire(SamplingParams())
    wire["temperature"] = -1.0
    with pytest.raises(ValueError, match="temperature"):
        serialization.params_from_wire(wire)


def test_param_of_validation_locations():
    assert _param_of(["stream_options", "include_usage"]) == "stream_options.include_usage"
    assert _param_of(["prompt", "list[constrained-int]", "1"]) == "prompt"
    assert _param_of(["messages", "0", "content"]) == "messages"
    assert _param_of([]) is None


def test_value_errors_name_their_param():
    error = from_value_error(ValueError("top_p must be in (0, 1], got 2"))
    assert error.status == 400 and error.param == "top_p"
    error = from_value_error(ValueError("prompt is 300 tokens ... max_model_len=256"), param="prompt")
    assert error.code == "context_length_exceeded"


def test_resolve_max_tokens():
    assert resolve_max_tokens(None, 10, 256, "prompt") == 246
    assert resolve_max_tokens(246, 10, 256, "prompt") == 246
    with pytest.raises(Exception, match="maximum context length"):
        resolve_max_tokens(247, 10, 256, "prompt")


def test_merge_streams_interleaves_and_closes_all_on_error():
    closed = []

    async def numbers(tag: str, n: int, fail: bool = False):
        try:
            for i in range(n):
                await asyncio.sleep(0)
                yield f"{tag}{i}"
            if fail:
                raise RuntimeError("boom")
            await asyncio.sleep(10)
        finally:
            closed.append(tag)

    async def run():
        got = []
        with pytest.raises(RuntimeError, match="boom"):
            async for index, item in merge_streams([numbers("a", 3), numbers("b", 2, fail=True)]):
                got.append((index, item))
        return got

    got = asyncio.run(run())
    assert (1, "b0") in got and (0, "a0") in got
    assert sorted(closed) == ["a", "b"]
