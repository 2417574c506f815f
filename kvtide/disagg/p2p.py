"""The p2p connector: a prefill instance hands a prompt's KV to a decode instance over ZMQ/TCP.

    router ──▶ prefill (kv_producer): computes the prompt (max_tokens 1), and as the request ends
               stages its blocks in host memory, frees its device blocks, and answers with
               kv_transfer_params {remote_host, remote_port, transfer_id, num_tokens, ...}
    router ──▶ decode (kv_consumer) with those params: pulls the staged blocks (authenticated),
               checks them, loads them into its own blocks and computes only the last prompt token

A staged prompt is pulled once, or dropped after kv_stage_ttl_s. Every pull is a signed request
(HMAC-SHA256 under the shared secret, with a timestamp and a nonce against replay) and every answer
is signed the same way; the blocks carry checksums. A pull that fails or times out costs the decode
instance the prompt's computation, never a wrong token or a hang.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import zmq

from kvtide.disagg.base import (
    ConnectorStats,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from kvtide.disagg.entry import checksum
from kvtide.engine.request import RequestStatus
from kvtide.net_auth import hmac_sha256, same_mac

logger = logging.getLogger(__name__)

MAX_CLOCK_SKEW_S = 60.0
"""A pull signed further from the producer's clock than this is refused (replay window)."""
PENDING_RETRY_S = 0.01
"""How soon a consumer asks again for a prompt its producer is still copying out."""
PULL_MAX_BYTES = 4096
"""Largest frame the transfer port accepts (ZMQ_MAXMSGSIZE): a pull is ~120 bytes of JSON and a
32-byte MAC. A frame announcing more is refused from its length header, before it is received,
and the connection dropped; a pull of more than two frames is refused after its second."""
ANSWER_HEADER_MAX_BYTES = 64 << 20
"""Largest answer header a consumer accepts: the prompt's token ids and one checksum per block
(about 10 bytes a token: room for prompts of millions of tokens). A block payload may be larger:
a consumer's bound is the larger of the two."""


def sign_params(secret: bytes, params: dict) -> str:
    """The producer's signature over the params it hands out: a consumer pulls only from params a
    producer of its deployment made, so a client cannot point it at another host or port."""
    fields = {k: params.get(k) for k in ("remote_host", "remote_port", "transfer_id", "num_tokens")}
    return hmac_sha256(secret, json.dumps(fields, sort_keys=True).encode()).hex()


@dataclass
class StagedPrompt:
    token_ids: list[int]
    payloads: list[bytes]
    expires: float

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.payloads)


class StagingStore:
    """Prompts staged by a producer, pulled once each, dropped when their time is up."""

    def __init__(self, ttl_s: float, max_bytes: int) -> None:
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.reserved_bytes = 0
        """Bytes staged, plus those promised to prompts not yet copied out."""
        self._entries: dict[str, StagedPrompt] = {}
        self._pending: dict[str, tuple[int, float]] = {}
        """transfer id -> (bytes promised, deadline) of prompts not yet copied out."""
        self._lock = threading.Lock()

    def reserve(self, transfer_id: str, nbytes: int) -> bool:
        """Promise `nbytes` to a prompt about to be staged; a pull for it waits until it is."""
        with self._lock:
            self._expire()
            if self.reserved_bytes + nbytes > self.max_bytes:
                return False
            self.reserved_bytes += nbytes
            self._pending[transfer_id] = (nbytes, time.monotonic() + self.ttl_s)
            return True

    def put(self, transfer_id: str, prompt: StagedPrompt) -> None:
        with self._lock:
            if self._pending.pop(transfer_id, None) is not None:
                self._entries[transfer_id] = prompt

    def take(self, transfer_id: str) -> StagedPrompt | None | bool:
        """The staged prompt (removed), True while it is still being staged, or None."""
        with self._lock:
            self._expire()
            if transfer_id in self._pending:
                return True
            prompt = self._entries.pop(transfer_id, None)
            if prompt is not None:
                self.reserved_bytes -= prompt.nbytes
            return prompt

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def _expire(self) -> None:
        now = time.monotonic()
        for tid in [t for t, p in self._entries.items() if p.expires < now]:
            self.reserved_bytes -= self._entries.pop(tid).nbytes
        for tid in [t for t, (_, deadline) in self._pending.items() if deadline < now]:
            self.reserved_bytes -= self._pending.pop(tid)[0]


class TransferServer:
    """The producer's port: answers signed pulls of staged prompts (one thread, a ROUTER socket)."""

    def __init__(self, store: StagingStore, secret: bytes, layout_id: str, host: str, port: int) -> None:
        self.store = store
        self.secret = secret
        self.layout_id = layout_id
        self.host = host
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, PULL_MAX_BYTES)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.port = port
        self.num_refused = 0
        self._seen_nonces: dict[bytes, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvtide-kv-transfer", daemon=True)
        self._thread.start()
        logger.info("KV transfer port: tcp://%s:%d", host, port)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            ident, rest = self._recv_pull()
            try:
                reply = self._answer(rest)
            except Exception as e:  # a malformed pull never stops the port
                logger.warning("KV transfer: bad pull (%s)", e)
                reply = self._signed({"error": "bad request"})
            self._sock.send_multipart([ident, *reply])
        self._sock.close(0)

    def _recv_pull(self) -> tuple[bytes, list[bytes]]:
        """(peer identity, frames): a pull's two frames, or three when it sent more (the rest are
        read one by one, each under PULL_MAX_BYTES, and dropped: never held together)."""
        ident = self._sock.recv()
        frames: list[bytes] = []
        while self._sock.getsockopt(zmq.RCVMORE):
            frame = self._sock.recv()
            if len(frames) < 3:
                frames.append(frame)
        return ident, frames

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) != 2 or not same_mac(hmac_sha256(self.secret, frames[0]), frames[1]):
            self.num_refused += 1
            logger.warning("KV transfer: refused a pull that is not signed with the shared secret")
            return [json.dumps({"error": "unauthorized"}).encode(), b""]
        pull = json.loads(frames[0])
        now = time.time()
        nonce = bytes.fromhex(pull["nonce"])
        self._seen_nonces = {n: t for n, t in self._seen_nonces.items() if t > now - 2 * MAX_CLOCK_SKEW_S}
        if abs(now - float(pull["ts"])) > MAX_CLOCK_SKEW_S or nonce in self._seen_nonces:
            self.num_refused += 1
            return self._signed({"error": "stale or replayed pull"})
        self._seen_nonces[nonce] = now
        prompt = self.store.take(str(pull["transfer_id"]))
        if prompt is True:
            return self._signed({"error": "pending", "nonce": pull["nonce"]})
        if prompt is None:
            return self._signed({"error": "unknown or expired transfer_id", "nonce": pull["nonce"]})
        header = {"nonce": pull["nonce"], "layout_id": self.layout_id, "token_ids": prompt.token_ids,
                  "checksums": [checksum(p) for p in prompt.payloads]}
        return self._signed(header) + prompt.payloads

    def _signed(self, header: dict) -> list[bytes]:
        data = json.dumps(header).encode()
        return [data, hmac_sha256(self.secret, data)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


def pull(host: str, port: int, transfer_id: str, secret: bytes, layout_id: str,
         timeout_s: float, block_bytes: int = 0) -> tuple[list[int], list[bytes]]:
    """(token ids, block payloads) of a staged prompt; raises on any failure (refused, expired,
    timed out, a bad signature or checksum, another layout). A prompt the producer is still
    copying out is asked for again until `timeout_s`. No answer frame may exceed a block
    (`block_bytes`) or ANSWER_HEADER_MAX_BYTES, whichever is larger."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return _pull_once(host, port, transfer_id, secret, layout_id, max(deadline - time.monotonic(), 0.01),
                              max(block_bytes, ANSWER_HEADER_MAX_BYTES))
        except _Pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the producer did not stage transfer {transfer_id} within {timeout_s:.0f} s") from None
            time.sleep(PENDING_RETRY_S)


class _Pending(Exception):
    pass


def _pull_once(host: str, port: int, transfer_id: str, secret: bytes, layout_id: str,
               timeout_s: float, max_frame_bytes: int) -> tuple[list[int], list[bytes]]:
    nonce = secrets.token_hex(16)
    body = json.dumps({"transfer_id": transfer_id, "ts": time.time(), "nonce": nonce}).encode()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send_multipart([body, hmac_sha256(secret, body)])
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer from {host}:{port} within {timeout_s:.0f} s") from None
        frames = sock.recv_multipart()
    finally:
        sock.close(0)
    if len(frames) < 2 or not same_mac(hmac_sha256(secret, frames[0]), frames[1]):
        raise PermissionError("the producer's answer is not signed with the shared secret")
    header = json.loads(frames[0])
    if header.get("error") == "pending" and header.get("nonce") == nonce:
        raise _Pending
    if "error" in header:
        raise LookupError(header["error"])
    if header.get("nonce") != nonce:
        raise PermissionError("the producer's answer is for another pull")
    if header["layout_id"] != layout_id:
        raise ValueError("the producer's KV layout differs from this instance's (another model or cache dtype)")
    payloads = frames[2:]
    if [checksum(p) for p in payloads] != header["checksums"]:
        raise ValueError("a transferred block does not match its checksum")
    return header["token_ids"], payloads


@dataclass
class P2PMetadata(KVConnectorMetadata):
    stages: list[tuple[str, str, list[int], list[int]]] = field(default_factory=list)
    """(request id, transfer id, block ids, prompt token ids) to copy out, then free."""
    loads: list[tuple[int, bytes]] = field(default_factory=list)
    """(block id, payload) pulled from a producer."""


class P2PScheduler(KVConnectorScheduler):
    def __init__(self, config, store: StagingStore | None, server: TransferServer | None, layout_id: str,
                 block_bytes: int) -> None:
        self.config = config
        self.store = store
        self.server = server
        self.layout_id = layout_id
        self.block_bytes = block_bytes
        self.secret = config.secret()
        self.stats = ConnectorStats()
        self._pulls: dict[str, Future] = {}
        self._pool = ThreadPoolExecutor(4, "kvtide-kv-pull") if config.is_consumer else None
        self._stages: list[tuple[str, str, list[int], list[int]]] = []
        self._staging: set[str] = set()
        """Requests whose blocks are kept until the worker has staged them."""
        self._loads: list[tuple[int, bytes]] = []
        self._pulled: set[str] = set()
        """Requests whose pull is over (loaded or failed): never pulled again."""

    # ---- requests ----------------------------------------------------------------------------
    def check_request(self, request) -> None:
        params = request.sampling_params.kv_transfer_params
        if params is None or not params.get("do_remote_prefill"):
            return
        for key, kind in (("remote_host", str), ("remote_port", int), ("transfer_id", str), ("num_tokens", int)):
            if not isinstance(params.get(key), kind) or isinstance(params.get(key), bool):
                raise ValueError(f"kv_transfer_params.{key} must be a {kind.__name__} when do_remote_prefill is set")
        if not 0 < params["remote_port"] < 65536 or params["num_tokens"] < 0:
            raise ValueError("kv_transfer_params: remote_port or num_tokens out of range")
        if not isinstance(params.get("signature"), str) or not hmac.compare_digest(
                params["signature"], sign_params(self.secret, params)):
            raise ValueError("kv_transfer_params are not signed by a prefill instance of this deployment "
                             "(the shared secret differs, or they were altered)")

    def _wants_pull(self, request) -> bool:
        params = request.sampling_params.kv_transfer_params
        # A request asking for prompt logprobs computes its prompt: they come from the forward pass.
        return bool(self.config.is_consumer and params and params.get("do_remote_prefill")
                    and request.request_id not in self._pulled and request.sampling_params.prompt_logprobs is None)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int | None:
        if not self._wants_pull(request):
            return 0
        params = request.sampling_params.kv_transfer_params
        future = self._pulls.get(request.request_id)
        if future is None:
            assert self._pool is not None
            self._pulls[request.request_id] = self._pool.submit(
                pull, params["remote_host"], params["remote_port"], params["transfer_id"], self.secret,
                self.layout_id, self.config.kv_transfer_timeout_s, self.block_bytes)
            return None
        if not future.done():
            return None
        try:
            token_ids, payloads = future.result()
        except Exception as e:
            self._pulls.pop(request.request_id)
            self.stats.transfer_failures += 1
            logger.warning("KV transfer for request %s failed (%s); computing its prompt here", request.request_id, e)
            self._pulled.add(request.request_id)
            return 0
        usable = min(len(token_ids), request.num_tokens - 1, len(payloads) * self.block_size)
        if token_ids[:usable] != request.all_token_ids[:usable]:
            self._pulls.pop(request.request_id)
            self.stats.transfer_failures += 1
            logger.warning("KV transfer for request %s holds another prompt; computing it here", request.request_id)
            self._pulled.add(request.request_id)
            return 0
        return max(usable - num_computed_tokens, 0)

    def update_state_after_alloc(self, request, num_external_tokens: int) -> None:
        future = self._pulls.pop(request.request_id, None)
        if future is None:
            return
        self._pulled.add(request.request_id)  # loaded once: if preempted, the request computes its prompt
        if not num_external_tokens:
            return
        _, payloads = future.result()
        start = request.num_computed_tokens // self.block_size
        end = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size)
        blocks = self.kv_cache_manager.req_to_blocks[request.request_id]
        self._loads.extend((blocks[i].block_id, payloads[i]) for i in range(start, end))
        self.stats.hit_tokens["p2p"] = self.stats.hit_tokens.get("p2p", 0) + num_external_tokens

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._pulled.discard(request.request_id)
        future = self._pulls.pop(request.request_id, None)
        if future is not None:
            future.cancel()
        params = request.sampling_params.kv_transfer_params
        if (self.store is None or not params or not params.get("do_remote_decode")
                or request.status == RequestStatus.FINISHED_ABORTED
                or request.num_computed_tokens < request.num_prompt_tokens - 1):
            return False, None
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        transfer_id = secrets.token_hex(16)
        if len(block_ids) < num_blocks or not self.store.reserve(transfer_id, num_blocks * self.block_bytes):
            logger.warning("KV transfer: not staging request %s (staging memory full)", request.request_id)
            return False, None
        self._stages.append((request.request_id, transfer_id, block_ids[:num_blocks],
                             list(request.all_token_ids[:request.num_prompt_tokens])))
        self._staging.add(request.request_id)
        self.stats.staged_requests += 1
        assert self.server is not None
        params = {"do_remote_prefill": True, "remote_host": self.server.host, "remote_port": self.server.port,
                  "transfer_id": transfer_id, "num_tokens": request.num_prompt_tokens}
        params["signature"] = sign_params(self.secret, params)
        return True, params

    def build_connector_meta(self, scheduler_output, requests: dict) -> P2PMetadata:
        meta = P2PMetadata(self._stages, self._loads)
        self._stages, self._loads = [], []
        return meta

    def update_connector_output(self, output: KVConnectorOutput | None) -> set[str]:
        done = super().update_connector_output(output)
        self._staging -= done
        return done

    def has_pending_work(self) -> bool:
        return bool(self._stages or self._staging)

    def wait(self, timeout_s: float) -> None:
        pending = [f for f in self._pulls.values() if not f.done()]
        if pending:
            from concurrent.futures import FIRST_COMPLETED, wait

            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class P2PWorker(KVConnectorWorker):
    def __init__(self, store: StagingStore | None, ttl_s: float) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.server: TransferServer | None = None
        self._staged: set[str] = set()

    def start_load_kv(self, meta: P2PMetadata | None) -> None:
        """Stage finished prompts first (their blocks are kept for this), then load pulled ones."""
        self._staged = set()
        if meta is None:
            return
        for req_id, transfer_id, block_ids, token_ids in meta.stages:
            assert self.store is not None
            self.store.put(transfer_id, StagedPrompt(token_ids, self.block_io.read(block_ids),
                                                     time.monotonic() + self.ttl_s))
            self._staged.add(req_id)
        if meta.loads:
            ids, payloads = zip(*meta.loads, strict=True)
            self.block_io.write(list(ids), list(payloads))

    def save_kv(self, meta: P2PMetadata | None) -> KVConnectorOutput | None:
        return KVConnectorOutput(self._staged) if self._staged else None

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
