"""Hostile peers of the KV connectors: a frame claiming 300 MiB at the p2p transfer port is refused
from its length header (not received, not HMACed), and a Redis entry written by anyone without
the deployment's secret is never loaded: it is recomputed and counted."""

from __future__ import annotations

import socket
import struct
import time

import pytest
import redis
import xxhash
from test_kv_tiers import (
    BYTES_PER_BLOCK,
    check_same,
    connector_stats,
    make_llm,
    prompt,
    run,
    serve_once,
)

from kvtide.disagg.entry import pack
from kvtide.disagg.p2p import StagingStore, TransferServer, pull
from kvtide.disagg.tiers import RedisTier

SECRET = b"frames-test-secret"


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def zmtp_connect(host: str, port: int) -> socket.socket:
    """A raw TCP peer that speaks just enough ZMTP 3.0 (NULL mechanism, as a DEALER) to send frames
    the way an attacker would: nothing buffered on this side, whatever size it claims."""
    sock = socket.create_connection((host, port), timeout=10)
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
    sock.sendall(greeting)
    got = b""
    while len(got) < 64:
        chunk = sock.recv(64 - len(got))
        assert chunk, "the transfer port closed the connection during the greeting"
        got += chunk

    def prop(name: bytes, value: bytes) -> bytes:
        return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value

    ready = b"\x05READY" + prop(b"Socket-Type", b"DEALER") + prop(b"Identity", b"")
    sock.sendall(b"\x04" + bytes([len(ready)]) + ready)
    return sock


@pytest.mark.serial
def test_an_oversized_unsigned_frame_is_refused_from_its_header():
    server = TransferServer(StagingStore(60.0, 1 << 20), SECRET, "layout-a", "127.0.0.1", 0)
    try:
        claimed = 300 << 20
        before = rss_bytes()
        sock = zmtp_connect("127.0.0.1", server.port)
        started = time.monotonic()
        sock.sendall(b"\x02" + struct.pack(">Q", claimed))  # one long final frame of 300 MiB
        chunk, sent = bytes(1 << 20), 0
        try:
            while sent < claimed and time.monotonic() - started < 30:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:  # reset by the port: what must happen
            pass
        elapsed = time.monotonic() - started
        sock.close()
        time.sleep(0.3)  # let the port's thread finish with anything it took
        grown = rss_bytes() - before
        assert sent < 64 << 20, f"the port took {sent >> 20} MiB of a frame it must refuse from its header"
        assert elapsed < 5.0, elapsed
        assert grown < 64 << 20, f"RSS grew by {grown >> 20} MiB"
        # The port still serves signed pulls.
        with pytest.raises(LookupError, match="unknown or expired"):
            pull("127.0.0.1", server.port, "no-such-transfer", SECRET, "layout-a", 5.0)
    finally:
        server.close()



# ---- Redis entries ---------------------------------------------------------------------------------
def _entries(client: redis.Redis) -> dict[bytes, bytes]:
    return {k: client.get(k) for k in client.keys("kvtide:kv:*")}


def _forge_unsigned(blob: bytes, payload: bytes) -> bytes:
    """What any writer of the store could make before entries were signed: the old header, the
    right layout and length, a matching xxh3, someone else's KV."""
    return struct.pack("<4s16sQQ", b"KVT1", blob[4:20], len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = make_llm(llama_dir, None)
    yield run(llm, prompt(0))
    llm.shutdown()


def test_forged_redis_entries_are_recomputed_and_counted(llama_dir, reference, redis_url):
    config = {"kv_connector": "redis", "redis_url": redis_url}
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    serve_once(llama_dir, config, prompt(0))
    genuine = _entries(client)
    keys = sorted(genuine)
    assert len(keys) >= 10
    # Every entry replaced by an unsigned one holding another block's KV.
    for i, key in enumerate(keys):
        client.set(key, _forge_unsigned(genuine[key], genuine[keys[i - 1]][-BYTES_PER_BLOCK:]))
    llm = make_llm(llama_dir, config)
    try:
        out = run(llm, prompt(0))
        check_same(out, reference)  # nothing forged was loaded
        assert out.num_cached_tokens == 0  # the chain's first entry is refused: all computed
        stats = connector_stats(llm)
        assert (stats["rejected_entries"], stats["corrupt_entries"], stats["hit_tokens"]) == (1, 0, {}), stats
    finally:
        llm.shutdown()


def test_the_redis_tier_loads_only_entries_signed_for_their_key(redis_url):
    secret, layout = b"deployment-secret", "layout-0123456789"[:16]
    tier = RedisTier(redis_url, "auth-test", layout, ttl_s=60, secret=secret)
    client = redis.Redis.from_url(redis_url)
    k1, k2 = b"\x01" * 8, b"\x02" * 8
    p1, p2 = b"a" * 4096, b"b" * 4096
    try:
        tier.put_many([(k1, p1), (k2, p2)])
        assert tier.get_chain([k1, k2]) == [p1, p2]
        r1, r2 = tier._key(k1), tier._key(k2)
        genuine1 = client.get(r1)
        forgeries = {
            "unsigned": _forge_unsigned(genuine1, p2),
            "moved": client.get(r2),  # signed with the right secret, for another key
            "other secret": pack(b"another-secret", r1, layout, p2),
        }
        for rejected, (kind, blob) in enumerate(forgeries.items(), start=1):
            client.set(r1, blob)
            assert tier.get_chain([k1, k2]) == [], kind
            assert (tier.num_rejected, tier.num_corrupt) == (rejected, 0), kind
            assert not client.exists(r1), kind  # deleted, so a genuine entry can take its place
        damaged = bytearray(genuine1)
        damaged[-1] ^= 0xFF
        client.set(r1, bytes(damaged))
        assert tier.get_chain([k1, k2]) == []
        assert (tier.num_rejected, tier.num_corrupt) == (3, 1)  # damage is told apart from forgery
        client.set(r1, genuine1)
        assert tier.get_chain([k1, k2]) == [p1, p2]
    finally:
        client.delete(tier._key(k1), tier._key(k2))
        tier.close()
