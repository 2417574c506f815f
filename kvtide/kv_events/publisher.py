"""The ZMQ side of KV events: one thread owns the sockets, so the engine's step only appends a
batch to a bounded queue and never waits on a subscriber.

    PUB    (endpoint):        [topic, seq (8 bytes, big-endian), msgpack(KVEventBatch)]
    ROUTER (replay_endpoint): a REQ or DEALER client sends [b"", start seq]; it gets
                              [b"", seq, payload] for each kept batch from there on, then
                              [b"", seq -1 (signed), b""] to end the replay.

Sequence numbers count from 0, one per batch, so a subscriber sees a gap as a jump.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from urllib.parse import urlsplit, urlunsplit

import msgspec
import zmq

from kvtide.kv_events.config import KVEventsConfig
from kvtide.kv_events.events import KVCacheEvent, KVEventBatch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = object()


def offset_port(address: str, offset: int) -> str:
    """`tcp://host:PORT` with PORT + offset (each data-parallel replica binds its own)."""
    if not offset or not address.startswith("tcp://"):
        return address
    parts = urlsplit(address)
    host, _, port = parts.netloc.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"--kv-events-config: {address!r} has no port to offset for data-parallel rank {offset}")
    return urlunsplit(parts._replace(netloc=f"{host}:{int(port) + offset}"))


class KVEventPublisher:
    """Publishes each step's events as one KVEventBatch; `close` stops the thread."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_port(config.endpoint, data_parallel_rank or 0)
        self.replay_endpoint = None if config.replay_endpoint is None else \
            offset_port(config.replay_endpoint, data_parallel_rank or 0)
        self.num_dropped = 0
        """Batches dropped because the queue was full (a subscriber then sees nothing missing:
        sequence numbers are given as batches are sent; the log says so)."""
        self.num_published = 0
        self._queue: queue.Queue = queue.Queue(config.max_queue_size)
        self._encoder = msgspec.msgpack.Encoder()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if config.publisher == "zmq":
            self._thread = threading.Thread(target=self._run, name="kvtide-kv-events", daemon=True)
            self._thread.start()
            self._ready.wait(10)
            if self._error is not None:
                raise ValueError(f"--kv-events-config: cannot bind {self.endpoint} / {self.replay_endpoint}: "
                                 f"{self._error}") from self._error

    def publish(self, events: list[KVCacheEvent]) -> None:
        if not events or self._thread is None:
            return
        batch = KVEventBatch(time.time(), events, self.data_parallel_rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("KV events: %d batches dropped (the publisher thread is behind)", self.num_dropped)

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout=5)

    # ---- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        context = zmq.Context.instance()
        pub = replay = None
        try:
            pub = context.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(self.endpoint)
            if self.replay_endpoint is not None:
                replay = context.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._error = e
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(0)
            self._ready.set()
            return
        self._ready.set()
        kept: deque[tuple[bytes, bytes]] = deque(maxlen=self.config.buffer_steps)
        topic = self.config.topic.encode()
        seq = 0
        try:
            while True:
                if replay is not None:
                    while replay.poll(0):
                        self._replay(replay, kept)
                try:
                    batch = self._queue.get(timeout=0.02)
                except queue.Empty:
                    continue
                if batch is _STOP:
                    return
                payload = self._encoder.encode(batch)
                seq_bytes = seq.to_bytes(8, "big")
                pub.send_multipart((topic, seq_bytes, payload))
                kept.append((seq_bytes, payload))
                seq += 1
                self.num_published += 1
        except Exception:  # never take the engine down: events stop, serving goes on
            logger.exception("KV events publisher stopped")
        finally:
            pub.close(0)
            if replay is not None:
                replay.close(0)

    @staticmethod
    def _replay(replay: zmq.Socket, kept: deque[tuple[bytes, bytes]]) -> None:
        frames = replay.recv_multipart()
        identity, request = frames[0], frames[-1]
        if len(request) != 8:
            replay.send_multipart((identity, b"", END_SEQ, b""))
            return
        start = int.from_bytes(request, "big")
        for seq_bytes, payload in list(kept):
            if int.from_bytes(seq_bytes, "big") >= start:
                replay.send_multipart((identity, b"", seq_bytes, payload))
        replay.send_multipart((identity, b"", END_SEQ, b""))
