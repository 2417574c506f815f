"""SchedulerOutput and ModelRunnerOutput as msgpack (msgspec) for the worker ranks of a replica:
builtins only on the wire, so no rank ever unpickles bytes it received. Messages travel in the
engine's envelope (engine/serialization.py `encode`/`decode`: a list whose first element names it).

A structured-output step's matchers (a GrammarStep) live in the engine core and do not cross:
under tensor parallelism alone the rank there applies them and the others take its sampled tokens
(model_runner.receive_sampled_tokens); under pipeline parallelism the executor turns them into a
StepBitmask before the step (drafts cut, bitmask rows), which crosses as bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from kvtide.engine.serialization import params_from_wire, params_to_wire
from kvtide.pooling.params import PoolingParams
from kvtide.scheduler.output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from kvtide.structured_output.step import StepBitmask

_encoder = msgspec.msgpack.Encoder()
_output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)


def scheduler_output_to_wire(so: SchedulerOutput) -> dict[str, Any]:
    wire = {f.name: getattr(so, f.name) for f in dataclasses.fields(so) if f.name != "grammar"}
    wire["scheduled_new_reqs"] = [{**dataclasses.asdict(dataclasses.replace(r, sampling_params=None)),
                                   "sampling_params": params_to_wire(r.sampling_params)}
                                  for r in so.scheduled_new_reqs]
    wire["scheduled_cached_reqs"] = [dataclasses.asdict(c) for c in so.scheduled_cached_reqs]
    wire["finished_req_ids"] = sorted(so.finished_req_ids)
    wire["sampling_req_ids"] = sorted(so.sampling_req_ids)
    wire["grammar"] = so.grammar.to_wire() if isinstance(so.grammar, StepBitmask) else None
    return wire


def scheduler_output_from_wire(wire: dict[str, Any]) -> SchedulerOutput:
    fields = dict(wire)
    fields["scheduled_new_reqs"] = [NewRequestData(**{**r, "sampling_params": params_from_wire(r["sampling_params"]),
                                                      "pooling_params": PoolingParams.from_wire(r.get("pooling_params"))})
                                    for r in wire["scheduled_new_reqs"]]
    fields["scheduled_cached_reqs"] = [CachedRequestData(**c) for c in wire["scheduled_cached_reqs"]]
    fields["finished_req_ids"] = set(wire["finished_req_ids"])
    fields["sampling_req_ids"] = set(wire["sampling_req_ids"])
    fields["block_copies"] = [tuple(pair) for pair in wire["block_copies"]]
    fields["grammar"] = StepBitmask.from_wire(wire["grammar"]) if wire.get("grammar") is not None else None
    return SchedulerOutput(**fields)


def runner_output_to_wire(output: ModelRunnerOutput) -> bytes:
    return _encoder.encode(output)


def runner_output_from_wire(data: bytes) -> ModelRunnerOutput:
    return _output_decoder.decode(data)
