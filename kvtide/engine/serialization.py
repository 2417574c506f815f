"""The wire format between the API process and the engine-core process: msgpack via msgspec.

Every message is a msgpack array whose first element names it (the envelope, encode/decode, lives in
kvtide/wire_codec.py and is re-exported here for the channels that speak it). Payloads are builtins only (dicts,
lists, numbers, strings), so nothing on either side ever unpickles bytes it received.

    API -> core                                    core -> API
    ["add", [request, ...]]                        ["ready", model_info]
    ["abort", [request_id, ...]]                   ["startup_error", message]
    ["stop", [request_id, ...]]                    ["outputs", [output, ...], {request_id: scheduled_at}]
    ["utility", call_id, method, [args...]]        ["add_error", [request_id, ...], kind, message]
    ["shutdown"]                                   ["utility_result", call_id, ok, result]
                                                   ["fatal", message]

`add` carries all the child requests of one user request (n > 1), so they are admitted together
or not at all. `kind` of an add_error is "invalid" (400) or "queue_full" (429).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvtide.engine.messages import EngineCoreOutput, SchedulerStats
from kvtide.engine.request import EngineCoreRequest
from kvtide.pooling.params import PoolingParams
from kvtide.sampling_params import SamplingParams
from kvtide.wire_codec import decode as decode  # re-exported: the envelope of every message here
from kvtide.wire_codec import encode as encode

_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "all_stop_token_ids")


# ---- SamplingParams ----------------------------------------------------------------------------
def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """SamplingParams as a plain dict (the engine-filled stop ids included)."""
    wire = {name: getattr(params, name) for name in _PARAM_FIELDS}
    wire["all_stop_token_ids"] = sorted(params.all_stop_token_ids)
    return wire


def params_from_wire(wire: dict[str, Any]) -> SamplingParams:
    fields = dict(wire)
    all_stop = fields.pop("all_stop_token_ids", [])
    params = SamplingParams(**fields)  # validates again: the core trusts no bytes blindly
    params.all_stop_token_ids = set(all_stop)
    return params


# ---- EngineCoreRequest -------------------------------------------------------------------------
_REQUEST_FIELDS = tuple(f.name for f in dataclasses.fields(EngineCoreRequest))


def request_to_wire(request: EngineCoreRequest) -> dict[str, Any]:
    """Every EngineCoreRequest field (so a field added there crosses without a change here), with
    SamplingParams as a plain dict."""
    wire = {name: getattr(request, name) for name in _REQUEST_FIELDS}
    wire["sampling_params"] = params_to_wire(request.sampling_params)
    wire["prompt_token_ids"] = list(request.prompt_token_ids)
    wire["pooling_params"] = request.pooling_params.to_wire() if request.pooling_params is not None else None
    return wire


def request_from_wire(wire: dict[str, Any]) -> EngineCoreRequest:
    fields = {name: wire[name] for name in _REQUEST_FIELDS if name in wire}
    fields["sampling_params"] = params_from_wire(wire["sampling_params"])
    fields["pooling_params"] = PoolingParams.from_wire(wire.get("pooling_params"))
    return EngineCoreRequest(**fields)


# ---- outputs and stats -------------------------------------------------------------------------
def output_from_wire(wire: dict[str, Any]) -> EngineCoreOutput:
    return EngineCoreOutput(**wire)


def stats_from_wire(wire: dict[str, Any]) -> SchedulerStats:
    return SchedulerStats(**wire)
