"""A fake OpenAI-compatible /v1/completions server for the bench client tests, run by uvicorn in a thread.

Request k (counted from 0, the warm-up included) behaves by k % 6 when `faulty`:
  1 -> HTTP 500;  2 -> the connection drops mid-stream;  3 -> the stream ends without [DONE];
  4 -> [DONE] after one token but no finish_reason (a stream cut short);
  anything else -> `max_tokens` one-character chunks, `token_delay_s` apart, usage, [DONE].
/metrics exposes kvtide: counters: every successful request adds its prompt length to
prefix_cache_queries and half of it to prefix_cache_hits; every 500 adds one preemption.

`constrained_text(body) -> (text, finish_reason)`: the reply to a request with structured_outputs,
streamed one character per chunk; such requests also count in the structured-output families of
/metrics (one 5 ms compile per distinct constraint, the rest cache hits, every other character a
jump-forward token).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


class DroppedStream(Exception):
    pass


def make_app(faulty: bool = True, reject_ignore_eos: bool = False, token_delay_s: float = 0.002,
             empty_chunks: bool = False, constrained_text=None) -> FastAPI:
    """empty_chunks: every other token streams as an empty chunk, and a finish-only chunk ends."""
    app = FastAPI()
    state = {"count": 0, "queries": 0, "hits": 0, "preemptions": 0, "running": 0, "bodies": [],
             "generated": 0, "constrained": 0, "grammars": set(), "jump_forward": 0}
    app.state.fake = state

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        text = (
            "# TYPE kvtide:prefix_cache_queries counter\n"
            f"kvtide:prefix_cache_queries_total{{model_name=\"fake\"}} {state['queries']}\n"
            "# TYPE kvtide:prefix_cache_hits counter\n"
            f"kvtide:prefix_cache_hits_total{{model_name=\"fake\"}} {state['hits']}\n"
            "# TYPE kvtide:num_preemptions counter\n"
            f"kvtide:num_preemptions_total{{model_name=\"fake\"}} {state['preemptions']}\n"
            "# TYPE kvtide:num_requests_running gauge\n"
            f"kvtide:num_requests_running{{model_name=\"fake\"}} {state['running']}\n"
        )
        if constrained_text is not None:
            compiled = len(state["grammars"])
            text += (
                f"# TYPE kvtide:generation_tokens counter\nkvtide:generation_tokens_total {state['generated']}\n"
                "# TYPE kvtide:structured_output_requests counter\n"
                f"kvtide:structured_output_requests_total {state['constrained']}\n"
                "# TYPE kvtide:structured_output_grammar_cache_hits counter\n"
                f"kvtide:structured_output_grammar_cache_hits_total {state['constrained'] - compiled}\n"
                "# TYPE kvtide:structured_output_grammar_compile_seconds summary\n"
                f"kvtide:structured_output_grammar_compile_seconds_count {compiled}\n"
                f"kvtide:structured_output_grammar_compile_seconds_sum {0.005 * compiled}\n"
                "# TYPE kvtide:structured_output_jump_forward_tokens counter\n"
                f"kvtide:structured_output_jump_forward_tokens_total {state['jump_forward']}\n"
            )
        return PlainTextResponse(text)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        state["bodies"].append(body)
        if reject_ignore_eos and "ignore_eos" in body:
            return JSONResponse({"error": {"message": "unknown field ignore_eos"}}, status_code=400)
        k = state["count"]
        state["count"] += 1
        mode = k % 6 if faulty else 0
        if mode == 1:
            state["preemptions"] += 1
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        prompt = body["prompt"]
        prompt_len = len(prompt) if isinstance(prompt, (str, list)) else 1
        n = int(body.get("max_tokens", 16))
        usage = (body.get("stream_options") or {}).get("include_usage")
        if constrained_text is not None and body.get("structured_outputs") is not None:
            state["constrained"] += 1
            state["grammars"].add(json.dumps(body["structured_outputs"], sort_keys=True))
            reply, finish = constrained_text(body)
            state["generated"] += len(reply)
            state["jump_forward"] += len(reply) // 2
            return StreamingResponse(_stream_text(reply, finish, prompt_len, usage), media_type="text/event-stream")
        if constrained_text is not None:
            state["generated"] += n

        async def stream():
            state["running"] += 1
            try:
                for i in range(n):
                    await asyncio.sleep(token_delay_s)
                    if mode == 4 and i == 1:
                        yield "data: [DONE]\n\n"
                        return
                    if mode == 2 and i == n // 2:
                        raise DroppedStream("dropped on purpose")
                    text = "" if empty_chunks and i % 2 else "x"
                    last = i == n - 1 and not empty_chunks
                    chunk = {"id": f"cmpl-{k}", "object": "text_completion", "created": int(time.time()),
                             "model": body.get("model"),
                             "choices": [{"index": 0, "text": text, "finish_reason": "length" if last else None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                if empty_chunks:
                    yield "data: " + json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}) + "\n\n"
                if mode == 3:
                    return
                if usage:
                    yield "data: " + json.dumps({"choices": [], "usage": {
                        "prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}}) + "\n\n"
                state["queries"] += prompt_len
                state["hits"] += prompt_len // 2
                yield "data: [DONE]\n\n"
            finally:
                state["running"] -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


async def _stream_text(text: str, finish_reason: str, prompt_len: int, usage: bool):
    for i, char in enumerate(text):
        finish = finish_reason if i == len(text) - 1 else None
        yield "data: " + json.dumps({"choices": [{"index": 0, "text": char, "finish_reason": finish}]}) + "\n\n"
    if usage:
        yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": prompt_len,
                                                                "completion_tokens": len(text)}}) + "\n\n"
    yield "data: [DONE]\n\n"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 at a free port until stop()."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
