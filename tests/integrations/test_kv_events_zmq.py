"""KV events on vLLM's ZMQ wire, read back the way vLLM's consumers read them.

The consumer side here is written from vLLM's schema (vllm/distributed/kv_events.py, 0.32/0.33:
``KVEventBatch`` array-like ``[ts, events, data_parallel_rank]``; events tagged by class name,
``BlockStored`` requiring ``lora_name`` and ``medium``), strict about unknown fields, so a field
kvflow invents or forgets fails the decode. Where vLLM is installed, its own structs decode
the same bytes too.
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
import pytest

zmq = pytest.importorskip("zmq")

from kvflow.core.config import Config  # noqa: E402
from kvflow.engine.manager import OffloadManager  # noqa: E402
from kvflow.integrations.vllm.kv_events import KVEventPublisher  # noqa: E402
from kvflow.integrations.vllm.kv_events_zmq import END_SEQ, ZmqKVEventPublisher  # noqa: E402

B = 16


# --- vLLM's schema, as its consumers decode it ---------------------------------------------
class _Event(msgspec.Struct, omit_defaults=True, tag=True, forbid_unknown_fields=True):
    pass


class VBlockStored(_Event, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class VBlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VAllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]
    data_parallel_rank: int | None = None


DECODE = msgspec.msgpack.Decoder(VKVEventBatch).decode


def run_tier(publisher: ZmqKVEventPublisher) -> list[int]:
    """A manager whose KV events go out each step: store [1,2], evict one, reset."""
    m = OffloadManager(Config(cpu_blocks=2, block_tokens=B))
    collect = KVEventPublisher(B)
    m.subscribe(collect)
    job = m.blocks_computed("r", [1, 2], [10, 11])
    m.plan_step(0.0)
    m.job_result(job)
    publisher.publish(collect.take())
    m.finish_request("r")
    m.evict(1)
    publisher.publish(collect.take())
    m.reset()
    publisher.publish(collect.take())
    return [1, 2]


def receive(sub: Any, n: int, timeout_s: float = 10.0) -> list[list[bytes]]:
    out: list[list[bytes]] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n:
        assert time.monotonic() < deadline, f"received {len(out)} of {n} batches"
        if sub.poll(100):
            out.append(sub.recv_multipart())
    return out


@pytest.fixture
def publisher() -> Any:
    pub = ZmqKVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kv")
    yield pub
    pub.close()


def test_batches_reach_a_vllm_style_subscriber_in_order(publisher: ZmqKVEventPublisher) -> None:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(publisher.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.3)  # ZMQ's slow joiner: a SUB misses what is sent before it is connected
    run_tier(publisher)
    frames = receive(sub, 3)
    sub.close(linger=0)
    assert [f[0] for f in frames] == [b"kv"] * 3
    assert [int.from_bytes(f[1], "big") for f in frames] == [0, 1, 2]
    batches = [DECODE(f[2]) for f in frames]
    (stored,), (removed,), (cleared,) = (b.events for b in batches)
    assert isinstance(stored, VBlockStored) and stored.block_hashes == [1, 2]
    assert stored.medium == "CPU" and stored.lora_name is None and stored.block_size == B
    assert isinstance(removed, VBlockRemoved) and removed.medium == "CPU" and len(removed.block_hashes) == 1
    assert isinstance(cleared, VAllBlocksCleared)
    assert all(b.data_parallel_rank is None and b.ts > 0 for b in batches)


def test_the_replay_socket_resends_missed_batches_then_the_end_marker(publisher: ZmqKVEventPublisher) -> None:
    run_tier(publisher)
    deadline = time.monotonic() + 10
    while publisher.published < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.DEALER)
    req.connect(publisher.replay_endpoint)
    req.send_multipart((b"", (1).to_bytes(8, "big")))  # "everything from seq 1 on"
    got = []
    while True:
        assert req.poll(5000), "no replay answer"
        _, topic, seq, payload = req.recv_multipart()
        if seq == END_SEQ:
            break
        got.append((topic, int.from_bytes(seq, "big"), DECODE(payload)))
    req.close(linger=0)
    assert [(t, s) for t, s, _ in got] == [(b"kv", 1), (b"kv", 2)]
    assert isinstance(got[0][2].events[0], VBlockRemoved)


def test_vllms_own_structs_decode_the_payload() -> None:
    if os.environ.get("KVFLOW_REQUIRE_VLLM"):
        import vllm.distributed.kv_events as kv_events
    else:
        kv_events = pytest.importorskip("vllm.distributed.kv_events")
    m = OffloadManager(Config(cpu_blocks=2, block_tokens=B))
    collect = KVEventPublisher(B)
    m.subscribe(collect)
    job = m.blocks_computed("r", [1, 2], [10, 11])
    m.plan_step(0.0)
    m.job_result(job)
    from kvflow.integrations.vllm.kv_events import KVEventBatch

    wire = [msgspec.structs.replace(e, seq=0) for e in collect.take()]
    payload = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=wire))
    batch = msgspec.msgpack.decode(payload, type=kv_events.KVEventBatch)
    (stored,) = batch.events
    assert list(stored.block_hashes) == [1, 2] and stored.medium == "CPU"
