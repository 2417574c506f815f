"""KV-cache events (--kv-events-config): a ZMQ subscriber written here from vLLM's documented
schema reads what the engine publishes, and the set of cached blocks it rebuilds equals the
engine's own after a workload with evictions; missed batches come back by replay."""

from __future__ import annotations

import random
import socket
import time
from typing import Any

import msgspec
import pytest
import zmq

from kvtide import LLM, SamplingParams


# The subscriber's own types, from vLLM's documentation of KVEventBatch (field order and types).
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
BLOCK_SIZE = 16
TOPIC = "kv-events"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _apply(cached: set, batch: KVEventBatch) -> None:
    for event in batch.events:
        if isinstance(event, BlockStored):
            cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            cached.difference_update(event.block_hashes)
        else:
            cached.clear()


def _engine_hashes(llm: LLM) -> set[int]:
    """What the engine's pool holds, as a subscriber names it (the key's last 8 bytes, big-endian)."""
    pool = llm.engine.core.scheduler.kv_cache_manager.pool
    return {int.from_bytes(block.block_hash.hash_value[-8:], "big") for block in pool.blocks
            if block.block_hash is not None}


def _receive(sub: zmq.Socket, quiet_s: float = 0.5) -> list[tuple[int, bytes]]:
    """(seq, payload) of every live message until none arrives for `quiet_s`."""
    got = []
    while sub.poll(int(quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC.encode()
        got.append((int.from_bytes(seq, "big"), payload))
    return got


def _replay(context: zmq.Context, address: str, start: int) -> list[tuple[int, bytes]]:
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    got = []
    try:
        while True:
            assert dealer.poll(5000), "replay did not end"
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close()


@pytest.fixture(scope="module")
def events_llm(llama_dir):
    port, replay_port = _free_port(), _free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": TOPIC}
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    llm = LLM(llama_dir, kv_cache_memory="1MiB", block_size=BLOCK_SIZE, max_model_len=256,
              kv_events_config=config)
    sub.connect(config["endpoint"])
    time.sleep(0.3)  # the subscription reaches the publisher before anything is sent
    yield llm, context, sub, config
    sub.close()
    llm.engine.core.kv_events.close()
    context.term()


def test_subscriber_rebuilds_the_engines_cache_through_evictions(events_llm):
    llm, context, sub, config = events_llm
    pool = llm.engine.core.scheduler.kv_cache_manager.pool
    rng = random.Random(0)
    shared = [rng.randint(3, 250) for _ in range(3 * BLOCK_SIZE)]
    prompts = [shared + [rng.randint(3, 250) for _ in range(rng.randint(5, 60))] for _ in range(6)]
    prompts += [[rng.randint(3, 250) for _ in range(rng.randint(20, 90))] for _ in range(12)]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    evictions_before = pool.num_evictions
    first = prompts[0]
    for i in range(0, len(prompts), 6):
        llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + 6]], greedy)
    assert pool.num_evictions > evictions_before, "the workload must evict cached blocks"

    live = _receive(sub)
    assert [seq for seq, _ in live] == list(range(len(live))), "live batches in order, none missing"
    batches = [DECODER.decode(payload) for _, payload in live]
    cached: set = set()
    for batch in batches:
        assert batch.ts > 0 and batch.data_parallel_rank is None
        _apply(cached, batch)
    assert cached == _engine_hashes(llm) and cached
    kinds = {type(e).__name__ for b in batches for e in b.events}
    assert {"BlockStored", "BlockRemoved"} <= kinds

    # The first request's blocks went out as a chain with its tokens, block after block (a chain
    # may go on with a later request's blocks computed after its last one).
    stored = next(e for e in batches[0].events if isinstance(e, BlockStored))
    assert stored.parent_block_hash is None and stored.block_size == BLOCK_SIZE and stored.lora_id is None
    num_first = len(first) // BLOCK_SIZE
    assert stored.token_ids[:num_first * BLOCK_SIZE] == first[:num_first * BLOCK_SIZE]
    for event in (e for b in batches for e in b.events if isinstance(e, BlockStored)):
        assert len(event.token_ids) == len(event.block_hashes) * BLOCK_SIZE

    # A subscriber that missed everything asks for it again, from sequence 0.
    replayed = _replay(context, config["replay_endpoint"], 0)
    assert replayed == live
    assert _replay(context, config["replay_endpoint"], len(live) - 1) == live[-1:]


def test_reset_clears_every_block(events_llm):
    llm, _, sub, _ = events_llm
    llm.generate([{"prompt_token_ids": list(range(5, 5 + 2 * BLOCK_SIZE + 3))}],
                 SamplingParams(temperature=0.0, max_tokens=2))
    assert llm.reset_prefix_cache()
    batches = [DECODER.decode(p) for _, p in _receive(sub)]
    assert isinstance(batches[-1].events[-1], AllBlocksCleared)
    assert _engine_hashes(llm) == set()


@pytest.mark.parametrize("config,message", [
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher must be one of null, zmq"),
    ('{"enable_kv_cache_events": true, "endpoint": "localhost"}', "endpoint must be a ZMQ address"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps must be a positive integer"),
    ('{"enable_kv_cache_events": true, "topik": "x"}', "unknown field"),
    ("{not json", "not valid JSON"),
])
def test_bad_configs_are_refused(config, message):
    from kvtide.kv_events import parse_kv_events_config

    with pytest.raises(ValueError, match=message):
        parse_kv_events_config(config)


def test_events_need_prefix_caching(llama_dir):
    from kvtide.engine_args import EngineArgs

    args = EngineArgs(llama_dir, enable_prefix_caching=False,
                      kv_events_config={"enable_kv_cache_events": True, "publisher": "null"})
    with pytest.raises(ValueError, match="needs prefix caching"):
        args.create_engine_config(llama_dir)


def test_a_port_in_use_is_a_clear_startup_error(llama_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(ValueError, match="cannot bind"):
            LLM(llama_dir, kv_cache_memory="1MiB", max_model_len=256,
                kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": None})


def test_a_chain_under_a_lora_adapter_carries_its_id():
    """The first block's key names the adapter (prefix_cache.extra_keys_for); its chain inherits it,
    and a chain of the base model beside it says none."""
    from kvtide.kv_cache.prefix_cache import extra_keys_for, get_hash_fn, hash_request_blocks
    from kvtide.kv_events import KVEventRecorder

    hash_fn = get_hash_fn("sha256")
    tokens = list(range(3, 3 + 3 * BLOCK_SIZE))
    adapter, base = [], []
    hash_request_blocks(hash_fn, tokens, BLOCK_SIZE, adapter, lora_int_id=7)
    hash_request_blocks(hash_fn, tokens, BLOCK_SIZE, base)
    assert adapter[0].extra_keys == extra_keys_for(None, 7)
    recorder = KVEventRecorder()
    for keys in (adapter, base):
        for i, key in enumerate(keys):
            recorder.stored(key, keys[i - 1] if i else None)
    stored = recorder.take()
    assert [(len(e.block_hashes), e.lora_id) for e in stored] == [(3, 7), (3, None)]
    assert set(stored[0].block_hashes).isdisjoint(stored[1].block_hashes)
    recorder.stored(adapter[0], None)
    recorder.removed(adapter[0])
    assert [type(e).__name__ for e in recorder.take()] == ["BlockStored", "BlockRemoved"]
