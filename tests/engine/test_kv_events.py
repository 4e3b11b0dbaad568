"""KV events in vLLM's format (--kv-events-config): a subscriber written from vLLM's documented schema (msgspec
structs declared here, not the project's) decodes every batch, sees exactly what each tier holds, and a replay after
a gap returns exactly the batches it missed."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest
import zmq

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.wire.prefix_hash import block_hashes
from tests.helpers import free_port


# vLLM's documented schema (docs.vllm.ai, examples/online_serving/kv_events_subscriber.py), written out here.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
BLOCK = 16
PARAMS = SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True)


class Subscriber:
    """vLLM's documented subscriber: SUB on the topic, and a DEALER to the replay socket for what it missed (a REQ
    socket reads one reply per request; the replay streams several)."""

    def __init__(self, port: int, replay_port: int, topic: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.connect(f"tcp://127.0.0.1:{replay_port}")
        self.batches: dict[int, bytes] = {}  # seq -> payload

    def receive(self, until_seq: int, timeout_ms: int = 5000) -> list[tuple[int, bytes]]:
        """Every published batch up to ``until_seq`` that reaches the SUB socket (the first ones may not: slow joiner)."""
        got = []
        while self.sub.poll(timeout_ms):
            _topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            got.append((seq, payload))
            if seq >= until_seq:
                break
        return got

    def ask_replay(self, start: int) -> list[tuple[int, bytes]]:
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])  # REQ's envelope: an empty delimiter first
        out = []
        while self.replay.poll(5000):
            _empty, seq_bytes, payload = self.replay.recv_multipart()
            if not payload:
                return out
            out.append((int.from_bytes(seq_bytes, "big", signed=True), payload))
        raise AssertionError("the replay never ended with its end marker")

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def holdings(batches: list[KVEventBatch]) -> dict[str, set[int]]:
    """What each medium holds, replayed from the events alone."""
    held: dict[str, set[int]] = {}
    for batch in batches:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                held.clear()
            elif isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                held.setdefault(event.medium, set()).update(event.block_hashes)
            else:
                held.setdefault(event.medium, set()).difference_update(event.block_hashes)
    return held


def last_seq(llm: MegatronLLM) -> int:
    """The number of the last batch the engine's publisher was given."""
    return llm.engine.kv_events.seq_of(llm.engine.kv.publisher)


def prompts(count: int = 6, length: int = 5 * BLOCK + 3) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, 500) for _ in range(length)] for _ in range(count)]


@pytest.fixture
def published(tiny_llama):
    port, replay_port = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
              "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv-events"}
    llm = MegatronLLM(tiny_llama, InferenceConfig(block_size_tokens=BLOCK, num_kv_blocks=24, max_requests=2,
                                                  max_batch_tokens=256, kv_offloading_size=0.01,
                                                  kv_events_config=config))
    subscriber = Subscriber(port, replay_port, "kv-events")
    yield llm, subscriber
    subscriber.close()
    llm.engine.shutdown()


def test_a_subscriber_of_vllms_schema_decodes_every_batch_and_sees_what_each_tier_holds(published, tiny_llama):
    llm, subscriber = published
    engine = llm.engine
    batch = prompts()
    assert subscriber.sub.poll(0) == 0  # the start's AllBlocksCleared went out before anyone listened
    for prompt in batch:  # six prompts through a pool that holds two: blocks go to the host tier and come back
        llm.generate([prompt], PARAMS)
    for prompt in batch:
        llm.generate([prompt], PARAMS)
    last = engine.kv_events.seq_of(engine.kv.publisher)
    received = subscriber.receive(last)
    assert received and received[-1][0] == last
    missed = subscriber.ask_replay(0)  # the slow joiner's gap: the replay fills it
    seqs = sorted({seq for seq, _ in missed} | {seq for seq, _ in received})
    assert seqs == list(range(last + 1))
    payloads = dict(missed) | dict(received)
    decoded = [DECODER.decode(payloads[seq]) for seq in seqs]  # every batch decodes with vLLM's structs
    assert isinstance(decoded[0].events[0], AllBlocksCleared)
    held = holdings(decoded)
    assert held["GPU"] == set(engine.kv_events.holds("GPU")) == set(engine.allocator._block_of_hash)
    assert held["CPU"] == set(engine.kv_events.holds("CPU")) == set(engine.host_tier._slot_of_hash)
    assert held["CPU"] - held["GPU"]  # the pool let some go: the host tier holds them
    every_stored = {h for b in decoded for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes}
    for prompt in batch:  # the chain a router computes from a prompt is the one the events name
        assert set(block_hashes(prompt[: 5 * BLOCK], BLOCK)) <= every_stored

    engine.memory.refit(tiny_llama)  # new weights (the same ones, a new epoch): every tier forgets
    engine.kv_events.flush()
    cleared = subscriber.receive(last + 1)
    assert [seq for seq, _ in cleared] == [last + 1]
    assert [type(e) for e in DECODER.decode(cleared[0][1]).events] == [AllBlocksCleared]
    llm.generate([batch[0]], PARAMS)  # the new epoch's blocks carry other hashes
    after = subscriber.receive(engine.kv_events.seq_of(engine.kv.publisher))
    stored = {h for _, p in after for e in DECODER.decode(p).events if isinstance(e, BlockStored) for h in e.block_hashes}
    assert stored and not stored & set(block_hashes(batch[0][: 5 * BLOCK], BLOCK))


def test_a_replay_after_a_gap_returns_exactly_the_missed_batches(published):
    llm, subscriber = published
    received: dict[int, bytes] = {}
    for prompt in prompts(16):  # until four batches arrived: the first ones may go out before SUB is connected
        llm.generate([prompt], PARAMS)
        received |= dict(subscriber.receive(last_seq(llm)))
        if len(received) >= 4:
            break
    first_seen = min(received)
    gap = [seq for seq in sorted(received) if seq > first_seen][:3]  # the subscriber "loses" three batches
    assert len(gap) == 3
    replayed = subscriber.ask_replay(gap[0])
    assert [seq for seq, _ in replayed] == list(range(gap[0], last_seq(llm) + 1))
    assert all(payload == received[seq] for seq, payload in replayed)  # the same bytes as published
    assert subscriber.ask_replay(last_seq(llm) + 1) == []  # nothing past the last: the end marker alone
