"""The tier connectors on real engines: host memory after device eviction, Redis shared between
instances, damaged entries recomputed, another model's entries never read."""

from __future__ import annotations

import random

import pytest
import redis

from kvtide import LLM, SamplingParams
from kvtide.disagg.config import parse_kv_transfer_config
from kvtide.disagg.tiers import redact

BLOCK_SIZE = 16
BYTES_PER_BLOCK = 2 * BLOCK_SIZE * 2 * 32 * 4 * 4
"""The tiny Llama: K and V, 16 tokens, 2 KV heads of 32, 4 layers, float32."""


def make_llm(model_dir: str, connector: dict | None, num_blocks: int = 64) -> LLM:
    return LLM(model_dir, kv_cache_memory=str(num_blocks * BYTES_PER_BLOCK), block_size=BLOCK_SIZE,
               max_model_len=256, kv_transfer_config=connector)


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


def prompt(seed: int, n: int = 10 * BLOCK_SIZE + 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(3, 258) for _ in range(n)]


def run(llm: LLM, token_ids: list[int], max_tokens: int = 8):
    return llm.generate([{"prompt_token_ids": token_ids}], greedy(max_tokens), use_tqdm=False)[0]


def connector_stats(llm: LLM) -> dict:
    return llm.engine.core.get_stats().kv_connector


def flush(llm: LLM) -> None:
    llm.engine.core.kv_connector.worker.flush()


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = make_llm(llama_dir, None)
    yield {seed: run(llm, prompt(seed)) for seed in range(4)}
    llm.shutdown()


def serve_once(model_dir: str, config: dict, token_ids: list[int]):
    """Serve one prompt on a fresh engine, wait until its blocks reached the tiers, shut it down."""
    llm = make_llm(model_dir, config)
    try:
        out = run(llm, token_ids)
        flush(llm)
        return out
    finally:
        llm.shutdown()


def check_same(out, ref) -> None:
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    for got, want in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
        (tid, lp), = [(t, e.logprob) for t, e in got.items() if t in want]
        assert abs(lp - want[tid].logprob) < 1e-4


def test_cpu_tier_serves_a_prefix_the_device_evicted(llama_dir, reference):
    # 16 blocks: a prompt takes 11, so the next prompt evicts the first one's cached blocks.
    llm = make_llm(llama_dir, {"kv_connector": "cpu_offload"}, num_blocks=16)
    try:
        check_same(run(llm, prompt(0)), reference[0])
        check_same(run(llm, prompt(1)), reference[1])
        assert connector_stats(llm)["saved_blocks"].get("cpu", 0) >= 5
        out = run(llm, prompt(0))
        check_same(out, reference[0])
        assert out.num_cached_tokens == 10 * BLOCK_SIZE  # every full block but the last token's
        assert connector_stats(llm)["hit_tokens"]["cpu"] > 0
        llm.engine.core.check_integrity()
    finally:
        llm.shutdown()


def test_redis_tier_is_shared_between_instances(llama_dir, reference, redis_url):
    config = {"kv_connector": "redis", "redis_url": redis_url}
    check_same(serve_once(llama_dir, config, prompt(2)), reference[2])
    b = make_llm(llama_dir, config)  # an empty device cache
    try:
        out = run(b, prompt(2))
        check_same(out, reference[2])
        assert out.num_cached_tokens == 10 * BLOCK_SIZE
        assert connector_stats(b)["hit_tokens"] == {"redis": 10 * BLOCK_SIZE}
    finally:
        b.shutdown()
    client = redis.Redis.from_url(redis_url)
    keys = client.keys("kvtide:kv:*")
    assert keys and all(0 < client.ttl(k) <= 3600 for k in keys)  # redis_ttl_s's default


def test_multi_tier_stacks_host_memory_over_redis(llama_dir, reference, redis_url):
    llm = make_llm(llama_dir, {"kv_connector": "multi", "redis_url": redis_url, "kv_offload_memory": 64 << 20},
                   num_blocks=16)
    try:
        check_same(run(llm, prompt(3)), reference[3])
        check_same(run(llm, prompt(1)), reference[1])  # evicts prompt 3's blocks into host memory
        flush(llm)
        out = run(llm, prompt(3))
        check_same(out, reference[3])
        hits = connector_stats(llm)["hit_tokens"]
        assert hits.get("cpu", 0) > 0, hits  # the fastest tier that has them
    finally:
        llm.shutdown()


def test_damaged_redis_entries_are_detected_and_recomputed(llama_dir, reference, redis_url):
    config = {"kv_connector": "redis", "redis_url": redis_url}
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    serve_once(llama_dir, config, prompt(0))
    keys = sorted(client.keys("kvtide:kv:*"))
    assert len(keys) >= 10
    assert all(len(client.get(k)) > BYTES_PER_BLOCK for k in keys)  # header + every layer's K and V
    # One entry truncated, one with a flipped byte: whichever comes first in the chain stops it.
    client.set(keys[0], client.get(keys[0])[:-100])
    blob = bytearray(client.get(keys[1]))
    blob[len(blob) // 2] ^= 0xFF
    client.set(keys[1], bytes(blob))
    # Each instance reads the chain up to the first damaged entry, deletes it, computes the rest
    # and writes it back: the second damaged entry is met by the next instance, and after that the
    # whole prefix loads again.
    corrupt, cached = [], []
    for _ in range(3):
        llm = make_llm(llama_dir, config)
        try:
            out = run(llm, prompt(0))
            check_same(out, reference[0])
            corrupt.append(connector_stats(llm)["corrupt_entries"])
            cached.append(out.num_cached_tokens)
            flush(llm)
        finally:
            llm.shutdown()
    assert sum(corrupt) == 2 and corrupt[-1] == 0, corrupt
    assert cached[0] < 10 * BLOCK_SIZE and cached[-1] == 10 * BLOCK_SIZE, cached
    assert all(client.exists(k) for k in keys)


def test_another_model_never_reads_the_entries(llama_dir, checkpoint_factory, redis_url):
    config = {"kv_connector": "redis", "redis_url": redis_url}
    serve_once(llama_dir, config, prompt(0))
    other = checkpoint_factory("LlamaForCausalLM", seed=1)  # same shapes, other weights
    b = make_llm(other, config)
    try:
        assert run(b, prompt(0)).num_cached_tokens == 0
        assert connector_stats(b)["hit_tokens"] == {}
    finally:
        b.shutdown()


@pytest.mark.parametrize("config, message", [
    ({"kv_connector": "nope"}, "kv_connector must be one of"),
    ({"kv_connector": "redis", "kv_role": "boss"}, "kv_role must be one of"),
    ({"kv_connector": "redis", "redis_url": "http://x"}, "redis_url must start with"),
    ({"kv_connector": "cpu_offload", "bogus": 1}, "unknown field"),
    ({"kv_connector": "p2p", "kv_port": 70000, "kv_secret": "s"}, "kv_port"),
    ("{not json", "not valid JSON"),
])
def test_bad_kv_transfer_config_is_refused_before_loading(llama_dir, config, message, monkeypatch):
    monkeypatch.delenv("KVTIDE_KV_SECRET", raising=False)
    with pytest.raises(ValueError, match=message):
        make_llm(llama_dir, config)


def test_p2p_without_a_secret_is_refused(llama_dir, monkeypatch):
    monkeypatch.delenv("KVTIDE_KV_SECRET", raising=False)
    with pytest.raises(ValueError, match="shared secret"):
        make_llm(llama_dir, {"kv_connector": "p2p", "kv_role": "kv_producer"})


def test_unreachable_redis_is_a_clear_error(llama_dir):
    with pytest.raises(ValueError, match="cannot reach Redis"):
        make_llm(llama_dir, {"kv_connector": "redis", "redis_url": "redis://127.0.0.1:1/0"})


def test_kv_offload_memory_alone_turns_host_memory_offload_on():
    config = parse_kv_transfer_config(None, kv_offload_memory=123 << 20)
    assert (config.kv_connector, config.kv_offload_memory) == ("cpu_offload", 123 << 20)
    assert parse_kv_transfer_config(None) is None


def test_redis_password_never_reaches_the_log():
    assert redact("redis://user:hunter2@127.0.0.1:6379/0") == "redis://user:***@127.0.0.1:6379/0"
    assert redact("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_quantized_kv_cache_blocks_offload_and_load(llama_dir):
    """An int8 cache (codes and per-token scales in one byte layout) goes through host memory too."""
    int8_block = BYTES_PER_BLOCK // 4 * (32 + 2) // 32  # per head and token: 32 codes and a float16 scale

    def llm(connector):
        return LLM(llama_dir, kv_cache_memory=str(16 * int8_block), block_size=BLOCK_SIZE,
                   max_model_len=256, kv_cache_dtype="int8", kv_transfer_config=connector)

    plain = llm(None)
    try:
        want = run(plain, prompt(0)).outputs[0].token_ids
    finally:
        plain.shutdown()
    offload = llm({"kv_connector": "cpu_offload"})
    try:
        run(offload, prompt(0))
        run(offload, prompt(1))
        out = run(offload, prompt(0))
        assert out.num_cached_tokens == 10 * BLOCK_SIZE
        assert out.outputs[0].token_ids == want
        assert connector_stats(offload)["hit_tokens"]["cpu"] > 0  # the evicted tail of the prompt
        assert offload.engine.core.get_stats().num_blocks == 16
    finally:
        offload.shutdown()
