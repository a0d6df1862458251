"""KV events on vLLM's wire: a ZeroMQ publisher KV-event consumers of vLLM can subscribe to.

vLLM publishes its KV events (``--kv-events-config``) on a ZMQ PUB socket as multipart messages
``(topic, sequence, payload)``: the sequence an 8-byte big-endian counter from 0, the payload a
msgpack ``KVEventBatch`` ``[ts, events, data_parallel_rank]``. A ROUTER socket answers replay
requests for missed batches: a client sends ``(b"", start_seq)`` (8 bytes, big-endian) and gets
every buffered batch from that sequence on, each as ``(b"", topic, seq, payload)``, then the end
marker ``(b"", b"", -1 as 8 signed bytes, b"")``. This module speaks the same protocol with
kvflow's events (``kvflow.integrations.vllm.kv_events``, medium ``CPU``), so a router or cache index built for
vLLM reads kvflow's tier unchanged.

``pyzmq`` is an optional dependency (``pip install 'kvflow[events]'``). The sockets live on one
background thread (ZMQ sockets are not thread-safe); ``publish`` only queues.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec

from kvflow.core.errors import ConfigError
from kvflow.integrations.vllm.kv_events import KVEvent, KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _zmq() -> Any:
    try:
        import zmq
    except ImportError:  # pragma: no cover - exercised only without the extra
        raise ConfigError("KV events over ZMQ need pyzmq: pip install 'kvflow[events]'") from None
    return zmq


class ZmqKVEventPublisher:
    """Publish KV event batches as vLLM does. ``endpoint`` and ``replay_endpoint`` are ZMQ
    addresses to bind (``tcp://*:5557``; a tcp port of 0 picks a free one: read
    ``.endpoint`` / ``.replay_endpoint`` after construction). The last ``buffer_steps``
    batches are kept for replay."""

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int | None = None,
    ) -> None:
        if buffer_steps < 1:
            raise ConfigError(f"buffer_steps must be >= 1, got {buffer_steps}")
        zmq = _zmq()
        self.topic = topic.encode("utf-8")
        self.data_parallel_rank = data_parallel_rank
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self.endpoint = _bind(self._pub, endpoint)
        self._replay: Any = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            self.replay_endpoint = _bind(self._replay, replay_endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue()
        self._next_seq = 0
        self.published = 0
        self._thread = threading.Thread(target=self._run, name="kvflow-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> None:
        """Queue one batch (nothing is sent for an empty one). kvflow's ``seq`` stays home:
        the wire carries vLLM's fields only."""
        if not events:
            return
        wire = [msgspec.structs.replace(e, seq=0) if e.seq else e for e in events]
        batch = KVEventBatch(ts=time.time() if ts is None else ts, events=wire, data_parallel_rank=self.data_parallel_rank)
        self._queue.put(batch)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)

    def __enter__(self) -> ZmqKVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the socket thread -------------------------------------------------------------

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    batch = self._queue.get(timeout=0.01)
                except queue.Empty:
                    continue
                if batch is None:
                    return
                seq, self._next_seq = self._next_seq, self._next_seq + 1
                payload = encode(batch)
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.published += 1
        finally:
            self._pub.close(linger=1000)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return  # not a replay request: ignored, as vLLM does
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _bind(sock: Any, endpoint: str) -> str:
    """Bind; a tcp port of 0 binds a free port. Returns the address actually bound."""
    if endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1] == "0":
        host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
        port = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"
    sock.bind(endpoint)
    return endpoint


__all__ = ["ZmqKVEventPublisher", "END_SEQ"]
