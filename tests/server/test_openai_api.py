"""Every endpoint, streamed and not, through the official `openai` client and httpx."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from serve_helpers import API_KEY, MAX_MODEL_LEN, MODEL_NAME, sse_events, wait_idle


def test_models_version_health(server):
    assert httpx.get(server.url("/health")).status_code == 200  # no key needed
    with server.client() as c:
        models = c.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL_NAME]
        assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
        assert (models["data"][0]["architecture"], models["data"][0]["model_impl"]) == ("LlamaForCausalLM", "kvtide")
        assert c.get("/version").json()["version"]


def test_openai_client_lists_models(openai_client):
    assert [m.id for m in openai_client.models.list()] == [MODEL_NAME]


# ---- completions ---------------------------------------------------------------------------------
def test_completion_stream_equals_non_stream(openai_client):
    kwargs = dict(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=12, temperature=0)
    full = openai_client.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens == len("The quick brown fox") + 1  # bytes + BOS
    assert full.usage.completion_tokens >= 1
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(openai_client.completions.create(**kwargs, stream=True,
                                                   stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completion_prompt_forms(server, openai_client):
    with server.client() as c:
        ids = c.post("/tokenize", json={"prompt": "abc"}).json()["tokens"]
    assert ids[0] == 0 and len(ids) == 4  # BOS + 3 bytes
    by_text = openai_client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=6, temperature=0)
    by_ids = openai_client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = openai_client.completions.create(model=MODEL_NAME, prompt=["abc", "xyz"], max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    batch_ids = openai_client.completions.create(model=MODEL_NAME, prompt=[ids, ids], max_tokens=6, temperature=0)
    assert [c.text for c in batch_ids.choices] == [by_text.choices[0].text] * 2
    assert batch_ids.usage.prompt_tokens == 8


def test_completion_n2_streamed_and_not(server, openai_client):
    full = openai_client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=8, n=2,
                                            temperature=1.0, seed=7)
    assert sorted(c.index for c in full.choices) == [0, 1]
    assert all(c.finish_reason for c in full.choices)
    stream = openai_client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=8, n=2,
                                              temperature=1.0, seed=7, stream=True)
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
    assert all(len(f) == 1 for f in finishes.values())
    # Seeded sampling: the same seed gives the same samples, streamed or not.
    assert texts == {c.index: c.text for c in full.choices}


def _printable_stop(text: str) -> str | None:
    """A two-character printable ASCII piece of `text` (not at its start), at its first occurrence."""
    for i in range(2, len(text) - 1):
        piece = text[i:i + 2]
        if all(33 <= ord(ch) < 127 for ch in piece) and text.index(piece) == i:
            return piece
    return None


def test_stop_string(openai_client):
    prompts = ["Once upon a time", "abcdefg", "Hello world", "0123456789", "kvtide", "The end.", "zzz"]
    for prompt in prompts:
        base = openai_client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0,
                                                extra_body={"ignore_eos": True})
        stop = _printable_stop(base.choices[0].text)
        if stop is not None:
            break
    else:
        pytest.skip("no printable pair in the tiny model's greedy outputs")
    expected = base.choices[0].text[:base.choices[0].text.index(stop)]
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                  extra_body={"ignore_eos": True})
    stopped = openai_client.completions.create(**kwargs)
    assert stopped.choices[0].text == expected
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra.get("stop_reason") == stop
    # Streamed: the first character of the stop string is held back, never sent.
    streamed = "".join(c.choices[0].text for c in openai_client.completions.create(**kwargs, stream=True))
    assert streamed == expected
    kept = openai_client.completions.create(**dict(kwargs, extra_body={"ignore_eos": True,
                                                                       "include_stop_str_in_output": True}))
    assert kept.choices[0].text == expected + stop


def test_completion_logprobs(openai_client):
    full = openai_client.completions.create(model=MODEL_NAME, prompt="logprobs", max_tokens=6, temperature=0,
                                            logprobs=3)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == full.usage.completion_tokens
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen >= max(top.values()) - 1e-5  # greedy picks the best
    assert lp.text_offset == sorted(lp.text_offset)
    streamed = list(openai_client.completions.create(model=MODEL_NAME, prompt="logprobs", max_tokens=6,
                                                     temperature=0, logprobs=3, stream=True))
    streamed_lps = [x for c in streamed for x in (c.choices[0].logprobs.token_logprobs if c.choices[0].logprobs else [])]
    assert streamed_lps == pytest.approx(lp.token_logprobs)


def test_suffix_rejected(server):  # echo is served: tests/server/test_sampling_switches.py
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "suffix": "end"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


def test_context_length(server):
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x" * 10, "max_tokens": MAX_MODEL_LEN})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert r.json()["error"]["param"] == "max_tokens"
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x" * MAX_MODEL_LEN})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        # No max_tokens: as many as fit.
        prompt = "y" * (MAX_MODEL_LEN - 5)  # + BOS: 4 tokens of room
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "temperature": 0,
                                            "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        assert r.json()["choices"][0]["finish_reason"] == "length"


# ---- chat ----------------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def test_chat_prompt_has_one_bos(server, openai_client):
    with server.client() as c:
        tokens = c.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert tokens[0] == 0 and 0 not in tokens[1:]
    full = openai_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0)
    assert full.usage.prompt_tokens == len(tokens)


def test_chat_stream_equals_non_stream(openai_client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=10, temperature=0)
    full = openai_client.chat.completions.create(**kwargs)
    assert full.choices[0].message.role == "assistant"
    chunks = list(openai_client.chat.completions.create(**kwargs, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_raw_sse_framing(server):
    with server.client() as c:
        for path, body in (("/v1/completions", {"prompt": "sse", "max_tokens": 4, "stream": True}),
                           ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "stream": True})):
            with c.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                events = sse_events(r.iter_lines())
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            assert all(e["id"] == events[0]["id"] and e["model"] == MODEL_NAME for e in events[:-1])


def test_chat_n2_and_logprobs(openai_client):
    full = openai_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, n=2,
                                                 temperature=0.8, seed=3, logprobs=True, top_logprobs=2)
    assert sorted(c.index for c in full.choices) == [0, 1]
    total = 0
    for choice in full.choices:
        entries = choice.logprobs.content
        total += len(entries)
        assert all(e.logprob <= 0 and len(e.top_logprobs) <= 2 for e in entries)
    assert total == full.usage.completion_tokens
    stream = openai_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, n=2,
                                                   temperature=0.8, seed=3, stream=True)
    roles, finishes = set(), {0: 0, 1: 0}
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.index)
            if c.finish_reason:
                finishes[c.index] += 1
    assert roles == {0, 1} and finishes == {0: 1, 1: 1}


def test_chat_stop_and_usage_non_stream(openai_client):
    full = openai_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3, temperature=0,
                                                 extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 3


def test_tokenize_detokenize(server):
    with server.client() as c:
        r = c.post("/tokenize", json={"prompt": "héllo", "add_special_tokens": False}).json()
        assert r["count"] == len("héllo".encode()) and r["max_model_len"] == MAX_MODEL_LEN
        assert c.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "héllo"
        bad = c.post("/detokenize", json={"tokens": [10**6]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# ---- batching and aborts -------------------------------------------------------------------------
def test_32_concurrent_greedy_equal_offline(llama_dir, async_openai_client):
    from kvtide import LLM, SamplingParams

    prompts = [f"request {i}: " + "abcdefghij"[: i % 10] for i in range(32)]

    async def run_all():
        return await asyncio.gather(*[
            async_openai_client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=8, temperature=0)
            for p in prompts])

    served = [r.choices[0].text for r in asyncio.run(run_all())]
    llm = LLM(llama_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=32)
    offline = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))]
    assert served == offline


def _stream_and_disconnect(server, path: str, body: dict) -> None:
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60.0) as c:
        with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                    if got == 3:
                        break
    # leaving both `with` blocks closes the connection mid-stream


def _wait_freed(server, baseline: dict, timeout_s: float = 20.0) -> None:
    stats = wait_idle(server, timeout_s)
    assert stats["num_used_blocks"] == baseline["num_used_blocks"], (stats, baseline)


def test_disconnect_mid_stream_frees_blocks(server):
    baseline = wait_idle(server)
    body = {"model": MODEL_NAME, "prompt": "long " * 8, "max_tokens": 900, "ignore_eos": True, "stream": True}
    _stream_and_disconnect(server, "/v1/completions", body)
    _wait_freed(server, baseline)
    # n=2: both samples are aborted.
    _stream_and_disconnect(server, "/v1/completions", dict(body, n=2))
    _wait_freed(server, baseline)
    _stream_and_disconnect(server, "/v1/chat/completions",
                           {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 900, "ignore_eos": True,
                            "stream": True})
    _wait_freed(server, baseline)
    with server.client() as c:
        metrics = c.get("/metrics").text
    assert f'kvtide:num_requests_running{{model_name="{MODEL_NAME}"}} 0.0' in metrics
    assert 'finished_reason="abort"' in metrics
    with server.client() as c:
        assert c.post("/internal/check_integrity").json() == {"ok": True}


def test_disconnect_non_streamed_frees_blocks(server):
    baseline = wait_idle(server)
    # Far more tokens than the 0.3 s before the client gives up can produce.
    body = {"model": MODEL_NAME, "prompt": "wait " * 8, "max_tokens": 900, "ignore_eos": True, "n": 2}
    with httpx.Client(base_url=server.base_url, headers=server.headers) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.3))
    _wait_freed(server, baseline)


def test_metrics(server, openai_client):
    openai_client.completions.create(model=MODEL_NAME, prompt="metrics", max_tokens=3, temperature=0)
    with server.client() as c:
        text = c.get("/metrics").text
    for name in ("kvtide:time_to_first_token_seconds_count", "kvtide:inter_token_latency_seconds_count",
                 "kvtide:request_time_per_output_token_seconds_count", "kvtide:e2e_request_latency_seconds_count",
                 "kvtide:request_queue_time_seconds_count", "kvtide:num_requests_waiting",
                 "kvtide:kv_cache_usage_perc", "kvtide:prompt_tokens_total", "kvtide:generation_tokens_total",
                 "kvtide:num_preemptions_total", "kvtide:request_success_total",
                 "kvtide:prefix_cache_queries_total", "kvtide:prefix_cache_hits_total"):
        assert name in text, name
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("kvtide:") and "{" in line}
    assert values["kvtide:generation_tokens_total"] >= 3
    assert values["kvtide:e2e_request_latency_seconds_count"] >= 1
    # One log line per finished request.
    deadline = time.monotonic() + 5
    while "finished (length): prompt_tokens=8 output_tokens=3" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "finished (length): prompt_tokens=8 output_tokens=3" in server.log()


def test_api_key_on_openai_client(server):
    import openai

    bad = openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY + "x", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
