"""cache_aware keeps a shared prefix on one backend, so the backends' prefix caches hit more than
under round_robin on the same kind of workload (4 prefixes x 4 requests, each prefix's requests in
a row)."""

from __future__ import annotations

import random

import httpx
from router_helpers import MODEL_NAME, metric_value, sse_events, start_router

NUM_PREFIXES, REQUESTS_PER_PREFIX = 4, 4
PREFIX_CHARS, SUFFIX_CHARS = 256, 24


def _workload(seed: int) -> list[list[str]]:
    """Per prefix, its requests' prompts (a fresh seed per policy: the backends' caches outlive a
    router, so each run needs prefixes no backend saw)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz "

    def text(n: int) -> str:
        return "".join(rng.choice(letters) for _ in range(n))

    return [[prefix + text(SUFFIX_CHARS) for _ in range(REQUESTS_PER_PREFIX)]
            for prefix in (text(PREFIX_CHARS) for _ in range(NUM_PREFIXES))]


def _run(policy: str, seed: int, backends) -> tuple[int, list[dict[str, float]]]:
    """(prefix-cache hit tokens summed over the backends, per prefix: requests each backend got)."""
    urls = [b.base_url for b in backends]
    router = start_router("--backends", ",".join(urls), "--policy", policy)
    try:
        hits_before = sum(b.stats()["prefix_cache_hits"] for b in backends)
        placements = []
        for prompts in _workload(seed):
            before = router.metrics()
            for prompt in prompts:
                r = httpx.post(router.url("/v1/completions"), timeout=60.0,
                               json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0.0})
                assert r.status_code == 200, r.text
            after = router.metrics()
            placements.append({url: metric_value(after, "kvtide_router_requests_total", backend=url)
                               - metric_value(before, "kvtide_router_requests_total", backend=url) for url in urls})
        hits = sum(b.stats()["prefix_cache_hits"] for b in backends) - hits_before
        return hits, placements
    finally:
        router.stop()


def test_cache_aware_beats_round_robin_on_shared_prefixes(backend_a, backend_b):
    backends = [backend_a, backend_b]
    rr_hits, rr_placements = _run("round_robin", 1, backends)
    ca_hits, ca_placements = _run("cache_aware", 2, backends)
    # Each prefix's requests all went to one backend under cache_aware, to both under round robin.
    for placement in ca_placements:
        assert sorted(placement.values()) == [0, REQUESTS_PER_PREFIX], ca_placements
    for placement in rr_placements:
        assert sorted(placement.values()) == [REQUESTS_PER_PREFIX // 2] * 2, rr_placements
    # cache_aware computes each prefix once, round robin once per backend.
    assert ca_hits > rr_hits, (ca_hits, rr_hits)
    assert ca_hits >= (REQUESTS_PER_PREFIX - 1) * NUM_PREFIXES * (PREFIX_CHARS // 2)


def test_a_conversation_follows_its_backend_turn_after_turn(backend_a, backend_b):
    """Turn 2 repeats turn 1's prompt and answer: short turns make the answer most of it, so only
    an index that recorded the answer matches enough of the prompt to route by prefix."""
    urls = [backend_a.base_url, backend_b.base_url]
    router = start_router("--backends", ",".join(urls), "--policy", "cache_aware")
    rng = random.Random(5)
    try:
        for stream in (False, True):
            messages = [{"role": "user", "content": "".join(rng.choice("abcdefgh ") for _ in range(40))}]
            placements = []
            for _ in range(3):
                before = router.metrics()
                body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 48, "temperature": 0.0,
                        "ignore_eos": True, "stream": stream}
                if stream:
                    with httpx.stream("POST", router.url("/v1/chat/completions"), json=body, timeout=60.0) as r:
                        events = sse_events(r.iter_lines())
                    answer = "".join(e["choices"][0]["delta"].get("content") or ""
                                     for e in events[:-1] if e["choices"])
                else:
                    r = httpx.post(router.url("/v1/chat/completions"), json=body, timeout=60.0)
                    assert r.status_code == 200, r.text
                    answer = r.json()["choices"][0]["message"]["content"]
                after = router.metrics()
                placements.append([u for u in urls if metric_value(after, "kvtide_router_requests_total", backend=u)
                                   > metric_value(before, "kvtide_router_requests_total", backend=u)])
                messages = messages + [{"role": "assistant", "content": answer},
                                       {"role": "user", "content": "".join(rng.choice("abcdefgh ") for _ in range(8))}]
            assert len({tuple(p) for p in placements}) == 1, placements  # every turn on the first turn's backend
        text = router.metrics()
        assert metric_value(text, "kvtide_router_routing_decisions_total", decision="prefix_match") == 4
    finally:
        router.stop()


def test_answer_collector_reads_json_and_split_sse():
    from kvtide.router.prompt_text import AnswerCollector, answer_text

    whole = AnswerCollector()
    whole.feed_json(b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi there"}}]}')
    assert whole.text == "hi there"
    stream = AnswerCollector()
    sse = (b'data: {"choices": [{"index": 0, "delta": {"content": "hel"}}]}\n\n'
           b'data: {"choices": [{"index": 0, "delta": {"content": "lo"}}]}\n\ndata: [DONE]\n\n')
    for i in range(0, len(sse), 7):  # lines split across chunks
        stream.feed_sse(sse[i:i + 7])
    assert stream.text == "hello"
    assert answer_text("/v1/chat/completions", "hello") == "assistant: hello\n"
    assert answer_text("/v1/completions", "hello") == "hello"
