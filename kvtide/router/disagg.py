"""Prefill/decode disaggregation: each generation request runs as two.

    1. prefill pool: the client's body with max_tokens 1 (and max_completion_tokens 1 when the
       client used it), stream false, no stream_options, n or min_tokens, and
       "kv_transfer_params": {"do_remote_decode": true}; its JSON answer's top-level
       "kv_transfer_params" (absent or null: none) says where the computed KV cache waits.
    2. decode pool: the client's own body plus "kv_transfer_params": <that object> (left out when
       the prefill gave none), streamed or not as the client asked; this answer is relayed.

A prefill that fails (connection error, timeout, 5xx) is retried on another prefill backend; when
none is left the decode backend gets the request without kv_transfer_params and computes the
prompt itself (counted as a fallback). A 4xx from the prefill (a bad request) sends the client's
body to decode too, so the client gets the decode backend's own answer to its own body.
"""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.responses import Response

from kvtide.router.proxy import Failure, Upstream, finish, open_upstream, relay
from kvtide.router.state import RouterState

PREFILL_KV_PARAMS = {"do_remote_decode": True}


def prefill_body(payload: dict[str, Any]) -> dict[str, Any]:
    body = dict(payload)
    body["max_tokens"] = 1
    if "max_completion_tokens" in payload:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    for name in ("stream_options", "n", "min_tokens"):
        body.pop(name, None)
    body["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return body


def decode_body(payload: dict[str, Any], kv_transfer_params: Any) -> dict[str, Any]:
    body = dict(payload)
    body.pop("kv_transfer_params", None)
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return body


async def prefill_then_decode(state: RouterState, path: str, payload: dict[str, Any], headers: dict[str, str],
                              text: str, request_id: str) -> Response:
    assert state.prefill_policy is not None
    timeout = state.settings.request_timeout
    kv_transfer_params, prefilled = await _prefill(state, path, payload, headers, text, timeout)
    if not prefilled:
        state.metrics.prefill_fallbacks.inc()
    content = json.dumps(decode_body(payload, kv_transfer_params)).encode()
    stream = bool(payload.get("stream"))
    outcome = await open_upstream(state, state.policy, path, content, headers, text, stream=stream, timeout=timeout)
    if isinstance(outcome, Failure):
        return outcome.response
    if outcome.response.status_code == 200 and outcome.first_byte_at is not None:
        state.metrics.decode_ttft_seconds.observe(outcome.first_byte_at - outcome.started)
    return await relay(state, outcome, request_id)


async def _prefill(state: RouterState, path: str, payload: dict[str, Any], headers: dict[str, str], text: str,
                   timeout: float) -> tuple[Any, bool]:
    """(kv_transfer_params or None, whether a prefill backend did the prefill). A client error
    (4xx but 408/429) counts as done: decode then answers the client's body itself."""
    assert state.prefill_policy is not None
    started = time.perf_counter()
    content = json.dumps(prefill_body(payload)).encode()
    outcome = await open_upstream(state, state.prefill_policy, path, content, headers, text, stream=False,
                                  timeout=timeout, retry_server_errors=True, retry_reason="prefill_failed")
    if not isinstance(outcome, Upstream):
        return None, False
    try:
        status = outcome.response.status_code
        if 400 <= status < 500 and status not in (408, 429):
            return None, True
        if status != 200:
            return None, False
        try:
            answer = json.loads(outcome.response.content)
        except ValueError:
            return None, False
        state.metrics.prefill_seconds.observe(time.perf_counter() - started)
        return (answer.get("kv_transfer_params") if isinstance(answer, dict) else None), True
    finally:
        await finish(state, outcome, outcome.response.status_code)
