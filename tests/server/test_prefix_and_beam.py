"""Prefix caching and beam search at the HTTP edge: cached_tokens in usage, cache_salt isolation,
the prefix-cache metrics, the guarded admin reset, and beam search on /v1/completions equal to
offline beam search on the same checkpoint."""

from __future__ import annotations

import json
import random
import uuid

import httpx
import pytest
from serve_helpers import MAX_MODEL_LEN, MODEL_NAME, wait_idle

from kvtide import LLM, SamplingParams
from kvtide.sampling_params import BeamSearchParams

BLOCK_SIZE = 16
"""The server's block size (EngineArgs' default)."""


def long_prompt() -> str:
    """A prompt of many full blocks that shares no block with any other test's (the uuid comes
    first, so even the first block is new)."""
    return f"{uuid.uuid4().hex} " + "the cached prefix is computed once. " * 8


def expected_hit(num_prompt_tokens: int) -> int:
    """Full blocks reused on a warm cache: all but the last token's block must be computed."""
    return (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def completion(client: httpx.Client, prompt, **body) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2,
                                             "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def streamed_usage(client: httpx.Client, path: str, body: dict) -> dict:
    """The usage of the final chunk of a stream with stream_options.include_usage."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == []
    return last["usage"]


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def scrape(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("kvtide:") and "{" in line}


# ---- cached_tokens and cache_salt ----------------------------------------------------------------
def test_completion_cached_tokens_and_salt(server, openai_client):
    prompt = long_prompt()
    with server.client() as c:
        cold = completion(c, prompt)["usage"]
        num_prompt = cold["prompt_tokens"]
        assert num_prompt > 4 * BLOCK_SIZE
        assert cached(cold) == 0
        assert cached(completion(c, prompt)["usage"]) == expected_hit(num_prompt)
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        assert cached(streamed_usage(c, "/v1/completions", body)) == expected_hit(num_prompt)
        # Another tenant: nothing shared, cold again; the same salt then hits its own blocks.
        assert cached(completion(c, prompt, cache_salt="tenant-b")["usage"]) == 0
        assert cached(streamed_usage(c, "/v1/completions", dict(body, cache_salt="tenant-c"))) == 0
        assert cached(completion(c, prompt, cache_salt="tenant-b")["usage"]) == expected_hit(num_prompt)
        # Two prompts in one request: their cached tokens add up, as their prompt tokens do.
        both = completion(c, [prompt, prompt])["usage"]
        assert both["prompt_tokens"] == 2 * num_prompt and cached(both) == 2 * expected_hit(num_prompt)
        bad = c.post("/v1/completions", json=dict(body, cache_salt=""))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
    # The official client reads it too.
    usage = openai_client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0).usage
    assert usage.prompt_tokens_details.cached_tokens == expected_hit(num_prompt)


def test_chat_cached_tokens_and_salt(server, openai_client):
    messages = [{"role": "system", "content": long_prompt()}, {"role": "user", "content": "hi"}]
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 2, "temperature": 0}
    salt = uuid.uuid4().hex  # the template's opening may be shared with other chats: a new tenant is cold
    with server.client() as c:
        first = c.post("/v1/chat/completions", json=dict(body, cache_salt=salt)).json()["usage"]
        assert cached(first) == 0
        hit = expected_hit(first["prompt_tokens"])
        assert hit > 0
        assert cached(streamed_usage(c, "/v1/chat/completions", dict(body, cache_salt=salt))) == hit
        c.post("/v1/chat/completions", json=body)  # without a salt: a tenant of its own
        assert cached(c.post("/v1/chat/completions", json=body).json()["usage"]) == hit
        assert cached(streamed_usage(c, "/v1/chat/completions", body)) == hit
    reply = openai_client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0,
                                                  extra_body={"cache_salt": uuid.uuid4().hex})
    assert reply.usage.prompt_tokens_details.cached_tokens == 0


# ---- metrics and the admin route -----------------------------------------------------------------
def test_prefix_metrics_and_admin_reset(server):
    prompt = long_prompt()
    with server.client() as c:
        completion(c, prompt)
        completion(c, prompt)
        wait_idle(server)
        m = scrape(c)
        queries, hits = m["kvtide:prefix_cache_queries_total"], m["kvtide:prefix_cache_hits_total"]
        assert 0 < hits < queries
        assert m["kvtide:prefix_cache_hit_rate"] == pytest.approx(hits / queries)
        # Idle: nothing in use, yet the cached prefixes still fill blocks (a full cache, not a leak).
        total = m["kvtide:kv_cache_blocks_total"]
        assert m["kvtide:kv_cache_blocks_in_use"] == 0
        assert 0 < m["kvtide:kv_cache_blocks_evictable"] <= total
        assert m["kvtide:kv_cache_usage_perc"] == 0

        assert httpx.post(server.url("/reset_prefix_cache")).status_code == 401  # still behind the key
        r = c.post("/reset_prefix_cache")
        assert r.status_code == 200 and r.json() == {"reset": True}
        assert scrape(c)["kvtide:kv_cache_blocks_evictable"] == 0
        assert cached(completion(c, prompt)["usage"]) == 0  # the cache was really emptied
        after = scrape(c)
        assert after["kvtide:prefix_cache_queries_total"] > queries  # counters never go back
        assert after["kvtide:kv_cache_blocks_evictable"] > 0


class _StubEngine:
    is_dead = False
    resets = 0

    async def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True


@pytest.mark.parametrize("enabled", [False, True])
def test_admin_route_is_off_unless_enabled(enabled):
    from fastapi.testclient import TestClient

    from kvtide.server.api_server import build_app
    from kvtide.server.metrics import ServerMetrics
    from kvtide.server.state import ServerSettings, ServerState

    engine = _StubEngine()
    settings = ServerSettings(served_model_names=["m"], api_key="k", enable_admin_api=enabled)
    client = TestClient(build_app(ServerState(engine=engine, settings=settings, metrics=ServerMetrics("m"))))
    assert client.post("/reset_prefix_cache").status_code == 401  # the key comes first, either way
    r = client.post("/reset_prefix_cache", headers={"Authorization": "Bearer k"})
    if enabled:
        assert r.status_code == 200 and r.json() == {"reset": True} and engine.resets == 1
    else:
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert engine.resets == 0


def test_cli_flag():
    import argparse

    from kvtide.server import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    assert parser.parse_args(["serve", "demo"]).enable_admin_api is False
    assert parser.parse_args(["serve", "demo", "--enable-admin-api"]).enable_admin_api is True


# ---- beam search ---------------------------------------------------------------------------------
def _beam_case(seed: int, num_stops: int) -> tuple[list[int], list[int]]:
    """A prompt and extra stop ids (as tests/prefix_caching/test_beam_search.py draws them), so that
    some beams finish early and the finished-beam ordering matters."""
    rng = random.Random(seed)
    prompt = [rng.randint(3, 258) for _ in range(rng.randint(5, 40))]
    return prompt, rng.sample(range(3, 259), num_stops)


@pytest.fixture(scope="module")
def offline_llm(llama_dir):
    return LLM(llama_dir, max_model_len=MAX_MODEL_LEN, kv_cache_memory="16MiB")


def test_beam_search_equals_offline(server, offline_llm, openai_client):
    # vLLM's convention: n is the beam width and all n beams come back, best first.
    prompt, stops = _beam_case(0, 12)
    with server.client() as c:
        r = completion(c, prompt, n=4, use_beam_search=True, max_tokens=12, stop_token_ids=stops)
    expected = offline_llm.beam_search([{"prompt_token_ids": prompt}],
                                       BeamSearchParams(beam_width=4, max_tokens=12))
    offline = offline_llm.generate([prompt], SamplingParams(n=4, use_beam_search=True, max_tokens=12,
                                                            stop_token_ids=stops))[0].outputs
    assert [ch["index"] for ch in r["choices"]] == [0, 1, 2, 3]
    assert [(ch["text"], ch["finish_reason"], ch["stop_reason"]) for ch in r["choices"]] == \
        [(o.text, o.finish_reason, o.stop_reason) for o in offline]
    assert len({ch["text"] for ch in r["choices"]}) == 4
    assert {ch["finish_reason"] for ch in r["choices"]} == {"stop", "length"}  # orders mixed ends
    assert r["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in offline)
    # Without stop ids, the same as LLM.beam_search (vLLM's offline API).
    with server.client() as c:
        r = completion(c, prompt, n=4, use_beam_search=True, max_tokens=12)
    assert [ch["text"] for ch in r["choices"]] == \
        [offline_llm.get_tokenizer().decode(s.tokens[len(prompt):], skip_special_tokens=True)
         for s in expected[0].sequences]

    # kvtide's beam_width: the n best of a wider search; length_penalty and early_stopping.
    prompt, stops = _beam_case(0, 20)
    params = dict(use_beam_search=True, beam_width=3, max_tokens=10, length_penalty=0.5, early_stopping="never",
                  stop_token_ids=stops)
    served = openai_client.completions.create(model=MODEL_NAME, prompt=prompt, n=2, max_tokens=10,
                                              extra_body={k: v for k, v in params.items() if k != "max_tokens"})
    offline = offline_llm.generate([prompt], SamplingParams(n=2, **params))[0].outputs
    assert [ch.text for ch in served.choices] == [o.text for o in offline]
    # Two prompts: each gets its n beams, numbered prompt_index * n + beam.
    with server.client() as c:
        r = completion(c, [prompt, prompt], n=2, **params)
    assert [ch["text"] for ch in r["choices"]] == [o.text for o in offline] * 2
    assert [ch["index"] for ch in r["choices"]] == [0, 1, 2, 3]
    wait_idle(server)
    with server.client() as c:
        assert c.post("/internal/check_integrity").json() == {"ok": True}


BEAM_ERRORS = [
    # (extra body, param named in the 400)
    ({"stream": True}, "stream"),
    ({"temperature": 0.7}, "temperature"),
    ({"top_p": 0.5}, "top_p"),
    ({"beam_width": 1}, "beam_width"),
    ({"stop": ["x"]}, "stop"),
    ({"early_stopping": "sometimes"}, "early_stopping"),
    ({"length_penalty": "long"}, "length_penalty"),
    ({"beam_width": 10_000}, "beam_width"),
]


def test_beam_search_errors(server):
    with server.client() as c:
        for extra, param in BEAM_ERRORS:
            body = {"model": MODEL_NAME, "prompt": "abc", "max_tokens": 4, "n": 2, "use_beam_search": True, **extra}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == param, (extra, r.json())
        # Temperature 0 (or omitted) is what beam search does anyway: accepted.
        assert c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "abc", "max_tokens": 2, "n": 2,
                                               "use_beam_search": True, "temperature": 0}).status_code == 200
