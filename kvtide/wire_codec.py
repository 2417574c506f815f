"""The msgpack envelope every process boundary uses (API <-> engine core, engine core <-> worker ranks).

A message is a msgpack array whose first element names it; payloads are builtins only, so no side
ever unpickles bytes it received. It sits below SamplingParams, which asks it whether a
user-supplied object (kv_transfer_params) can travel at all.
"""

from __future__ import annotations

from typing import Any

import msgspec

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def encode(message: list[Any]) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> list[Any]:
    message = _decoder.decode(data)
    if not isinstance(message, list) or not message or not isinstance(message[0], str):
        raise ValueError(f"malformed engine message: {message!r:.200}")
    return message
