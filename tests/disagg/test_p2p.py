"""The p2p connector between two real engines: a producer stages a prompt's KV as the request ends,
a consumer pulls it (signed, checked) and computes only the last prompt token."""

from __future__ import annotations

import hashlib
import hmac
import json
import time

import pytest
import zmq
from test_kv_tiers import BLOCK_SIZE, BYTES_PER_BLOCK, check_same, prompt

from kvtide import LLM, SamplingParams
from kvtide.disagg.p2p import sign_params

SECRET = "test-secret-123"


def make(model_dir: str, role: str | None, **extra) -> LLM:
    config = None if role is None else {"kv_connector": "p2p", "kv_role": role, "kv_secret": SECRET, **extra}
    return LLM(model_dir, kv_cache_memory=str(64 * BYTES_PER_BLOCK), block_size=BLOCK_SIZE, max_model_len=256,
               kv_transfer_config=config)


def params(max_tokens: int, kv: dict | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                          kv_transfer_params=kv)


def generate(llm: LLM, token_ids: list[int], p: SamplingParams):
    return llm.generate([{"prompt_token_ids": token_ids}], p, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def engines(llama_dir):
    ref, producer, consumer = make(llama_dir, None), make(llama_dir, "kv_producer"), make(llama_dir, "kv_consumer")
    yield ref, producer, consumer
    for llm in (ref, producer, consumer):
        llm.shutdown()


def used_blocks(llm: LLM) -> int:
    return llm.engine.core.get_stats().num_used_blocks


def test_decode_instance_continues_from_the_transferred_prompt(engines):
    ref, producer, consumer = engines
    for seed, n in ((10, 10 * BLOCK_SIZE + 5), (11, 4 * BLOCK_SIZE), (12, 7)):
        tokens = prompt(seed, n)
        want = generate(ref, tokens, params(8))
        first = generate(producer, tokens, params(1, {"do_remote_decode": True}))
        kv = first.kv_transfer_params
        assert kv is not None and kv["do_remote_prefill"] and kv["num_tokens"] == n
        assert used_blocks(producer) == 0  # staged in host memory, device blocks freed
        got = generate(consumer, tokens, params(8, kv))
        check_same(got, want)
        assert got.num_cached_tokens == n - 1  # all but the last prompt token came over
        assert used_blocks(consumer) == 0
    stats = consumer.engine.core.get_stats().kv_connector
    assert stats["hit_tokens"]["p2p"] == 10 * BLOCK_SIZE + 4 + 4 * BLOCK_SIZE - 1 + 6
    assert stats["transfer_failures"] == 0
    producer.engine.core.check_integrity()
    consumer.engine.core.check_integrity()


def test_a_lost_transfer_is_computed_instead(engines):
    ref, producer, consumer = engines
    tokens = prompt(13)
    want = generate(ref, tokens, params(6))
    kv = generate(producer, tokens, params(1, {"do_remote_decode": True})).kv_transfer_params
    # Someone else pulls it first (a staged prompt is handed out once): the consumer computes it.
    generate(consumer, tokens, params(1, kv))
    before = consumer.engine.core.get_stats().kv_connector["transfer_failures"]
    got = generate(consumer, tokens, params(6, kv))
    check_same(got, want)
    assert consumer.engine.core.get_stats().kv_connector["transfer_failures"] == before + 1


def test_a_dead_producer_costs_computation_not_a_hang(engines, llama_dir):
    ref, producer, consumer = engines
    tokens = prompt(14)
    want = generate(ref, tokens, params(6))
    dead = dict(generate(producer, tokens, params(1, {"do_remote_decode": True})).kv_transfer_params)
    # Params that point at a port nobody answers on (as a producer that died would leave them).
    dead["remote_port"] = 9
    dead["signature"] = sign_params(SECRET.encode(), dead)
    quick = make(llama_dir, "kv_consumer", kv_transfer_timeout_s=1.0)
    try:
        start = time.monotonic()
        got = generate(quick, tokens, params(6, dead))
        assert time.monotonic() - start < 15
        check_same(got, want)
        assert got.num_cached_tokens == 0
        assert used_blocks(quick) == 0
    finally:
        quick.shutdown()


def test_transfer_port_refuses_unsigned_and_replayed_pulls(engines):
    _, producer, _ = engines
    server = producer.engine.core.kv_connector.scheduler.server
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{server.host}:{server.port}")
    try:
        body = json.dumps({"transfer_id": "x", "ts": time.time(), "nonce": "00" * 16}).encode()
        sock.send_multipart([body, hmac.new(b"wrong", body, hashlib.sha256).digest()])
        assert sock.poll(5000)
        assert json.loads(sock.recv_multipart()[0]) == {"error": "unauthorized"}
        signed = hmac.new(SECRET.encode(), body, hashlib.sha256).digest()
        for expected in ("unknown or expired transfer_id", "stale or replayed pull"):
            sock.send_multipart([body, signed])
            assert sock.poll(5000)
            assert json.loads(sock.recv_multipart()[0])["error"] == expected
    finally:
        sock.close(0)
    assert server.num_refused >= 2


@pytest.mark.parametrize("kv, message", [
    ({"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": "x", "transfer_id": "t", "num_tokens": 3},
     "remote_port"),
    ({"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5, "num_tokens": 3}, "transfer_id"),
    # Well formed, but made up by a client: the consumer must not connect to whatever it names.
    ({"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_port": 6379, "transfer_id": "t", "num_tokens": 3,
      "signature": "00" * 32}, "not signed"),
])
def test_bad_kv_transfer_params_are_refused(engines, kv, message):
    _, _, consumer = engines
    with pytest.raises(ValueError, match=message):
        generate(consumer, prompt(15), params(2, kv))
    assert used_blocks(consumer) == 0


def test_prompt_logprobs_are_computed_not_transferred(engines):
    ref, producer, consumer = engines
    tokens = prompt(16, 3 * BLOCK_SIZE)
    p = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    want = ref.generate([{"prompt_token_ids": tokens}], p, use_tqdm=False)[0]
    kv = generate(producer, tokens, params(1, {"do_remote_decode": True})).kv_transfer_params
    p.kv_transfer_params = kv
    got = consumer.generate([{"prompt_token_ids": tokens}], p, use_tqdm=False)[0]
    assert got.num_cached_tokens == 0
    assert len(got.prompt_logprobs) == len(want.prompt_logprobs) == len(tokens)
    for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
        (tid, entry), = [(t, e) for t, e in a.items() if t in b][:1]
        assert abs(entry.logprob - b[tid].logprob) < 1e-4
