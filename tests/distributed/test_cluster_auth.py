"""Only a node holding the deployment's secret joins a multi-node data-parallel head: peers that say
hello without it (the old protocol's bare hello, or an answer under another secret) are refused,
logged with their address, and get no data address, hence no prompt; the real node joins and
serves. Without $KVTIDE_DP_SECRET a rendezvous over a non-loopback address refuses to start, and a
loopback one uses the user's private secret file."""

from __future__ import annotations

import os
import time

import httpx
import pytest
import zmq
from serve_helpers import MODEL_NAME, free_port, wait_ready
from test_multi_node_data_parallel import Node, _start_head

from kvtide.engine import serialization
from kvtide.engine.dp_auth import SECRET_ENV, join_mac, loopback_cookie
from kvtide.engine.dp_client import check_data_parallel_args
from kvtide.engine.dp_remote import ConnectionWatch, _admit_only, join_head
from kvtide.engine_args import EngineArgs
from kvtide.net_auth import new_nonce

SECRET = "cluster-auth-test-secret"


def _ask(sock: zmq.Socket, message: list) -> list:
    sock.send(serialization.encode(message))
    assert sock.poll(30_000), "the rendezvous did not answer"
    return serialization.decode(sock.recv())


def test_only_a_node_with_the_secret_joins_and_gets_prompts(llama_dir, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)  # inherited by the head and the node
    rpc_port = free_port()
    address = f"tcp://127.0.0.1:{rpc_port}"
    head = _start_head(llama_dir, rpc_port)
    node = None
    context = zmq.Context()
    try:
        # The bare hello that was welcomed before (and then handed its rank's prompts).
        bare = context.socket(zmq.DEALER)
        bare.setsockopt(zmq.LINGER, 0)
        bare.connect(address)
        answer = _ask(bare, ["hello", 1, 2, "intruder"])
        assert answer[0] == "refused" and "not authenticated" in answer[1], answer

        # The real protocol, answered under another secret.
        wrong = context.socket(zmq.DEALER)
        wrong.setsockopt(zmq.LINGER, 0)
        wrong.connect(address)
        client_nonce = new_nonce()
        challenge = _ask(wrong, ["hello", 1, 2, "intruder", client_nonce])
        assert challenge[0] == "challenge"
        public, _ = zmq.curve_keypair()
        answer = _ask(wrong, ["auth", join_mac(b"another secret", client_nonce, challenge[1], 1, 2, "intruder",
                                               public), public])
        assert answer[0] == "refused" and "not authenticated" in answer[1], answer

        # A joiner under another secret finds the head does not prove this one: it never answers.
        monkeypatch.setenv(SECRET_ENV, "another secret")
        with pytest.raises(RuntimeError, match="did not prove it holds the deployment's secret"):
            join_head(address, 1, 2, timeout_s=30)
        monkeypatch.setenv(SECRET_ENV, SECRET)

        node = Node(llama_dir, rpc_port)
        wait_ready(head)
        with httpx.Client(base_url=head.base_url, headers=head.headers, timeout=60.0) as client:
            for i in range(4):
                r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": f"{i} joined", "max_tokens": 4,
                                                         "temperature": 0})
                assert r.status_code == 200, r.text
        engines = head.stats()["data_parallel"]
        assert all(e["requests"] > 0 for e in engines), engines  # the real node served its share
        for sock in (bare, wrong):  # the refused peers were never sent anything else
            assert not sock.poll(0)
        log = head.log()
        assert log.count("refused a join from 127.0.0.1") == 2, log[-3000:]
        assert "data-parallel engine 1 joined from" in log
    finally:
        context.destroy(linger=0)
        head.stop()
        if node is not None:
            node.stop()
        os.unlink(head.log_path)


def test_data_sockets_serve_only_the_joined_key_and_ignore_strangers():
    """The head's socket for a rank's requests, as the rendezvous binds it: a CURVE client with
    another key (one that learned the port and the server key) gets nothing, and its coming and
    going is not the replica's disconnection."""
    context = zmq.Context()
    server_key, server_secret = zmq.curve_keypair()
    joined_key, joined_secret = zmq.curve_keypair()
    authenticator = _admit_only(context, joined_key)
    head = context.socket(zmq.PUSH)
    head.setsockopt(zmq.LINGER, 0)
    head.curve_server, head.curve_publickey, head.curve_secretkey = True, server_key, server_secret
    head.zap_domain = b"kvtide-dp"
    watch = ConnectionWatch(head)
    port = head.bind_to_random_port("tcp://127.0.0.1")

    def client(public: bytes, secret: bytes) -> zmq.Socket:
        sock = context.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_key, public, secret
        sock.connect(f"tcp://127.0.0.1:{port}")
        return sock

    try:
        stranger = client(*zmq.curve_keypair())
        replica = client(joined_key, joined_secret)
        for i in range(4):
            head.send(b"request %d" % i)
        assert [replica.recv() for _ in range(4)] == [b"request %d" % i for i in range(4)]
        assert not stranger.poll(500)
        stranger.close(0)
        time.sleep(0.5)
        assert not watch.check() and watch.connected
        replica.close(0)
        deadline = time.monotonic() + 5
        while not watch.check() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.dropped
    finally:
        watch.close()
        authenticator.stop()
        context.destroy(linger=0)


def test_a_non_loopback_rendezvous_needs_the_secret(monkeypatch, tmp_path):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.setenv("KVTIDE_CACHE", str(tmp_path))
    head = dict(data_parallel_size=2, data_parallel_size_local=1)
    for kwargs, headless in ((dict(head, data_parallel_address="10.0.0.1"), False),
                             (dict(head, data_parallel_address="10.0.0.1", data_parallel_start_rank=1), True)):
        started = time.monotonic()
        with pytest.raises(ValueError, match=f"over 10.0.0.1 needs a shared secret: set \\${SECRET_ENV}"):
            check_data_parallel_args(EngineArgs(model="demo", **kwargs), headless=headless)
        assert time.monotonic() - started < 1
    monkeypatch.setenv(SECRET_ENV, SECRET)
    check_data_parallel_args(EngineArgs(model="demo", data_parallel_address="10.0.0.1", **head))
    assert not (tmp_path / "dp-secret").exists()


def test_loopback_uses_a_private_per_user_secret_file(tmp_path):
    first = loopback_cookie(str(tmp_path))
    assert first == loopback_cookie(str(tmp_path)) and len(first) == 64
    cookie = tmp_path / "dp-secret"
    assert cookie.stat().st_mode & 0o777 == 0o600
    cookie.chmod(0o644)
    with pytest.raises(ValueError, match="readable by no one else"):
        loopback_cookie(str(tmp_path))
