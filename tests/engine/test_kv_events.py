"""KV events in vLLM 0.33's encoding (--kv-events-config). What a real engine publishes, in every event and medium
(stored, removed and cleared; GPU, CPU and the disk tier's STORAGE; the base model and a LoRA adapter), decodes with
vLLM 0.33's own structs (``vllm.distributed.kv_events``, in a process of its own: vllm_kv_events.py) and vLLM's
encoder gives back the same bytes; what the events say is what each tier holds; vLLM's own publisher, handed the
same batches, answers a replay with the same frames; a replay after a gap returns exactly the batches missed.
Control: the older positional layout (vLLM's earlier documented subscriber's) does not decode with vLLM 0.33's
structs."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, get_type_hints

import msgspec
import pytest
import zmq

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.wire.kv_events import BlockStored
from megatron_serve.wire.prefix_hash import block_hashes
from tests.helpers import free_port

from ..lora_adapters import make_peft_adapter

ROOT = Path(__file__).resolve().parents[2]
ANCHORS = ROOT / ".anchors"
DECODER_SCRIPT = Path(__file__).with_name("vllm_kv_events.py")
BLOCK = 16
TOPIC = "kv-events"
ADAPTER = "kv-adapter"
PARAMS = SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True)
TIERED = {("BlockStored", "GPU"), ("BlockStored", "CPU"), ("BlockStored", "STORAGE"),
          ("BlockRemoved", "GPU"), ("BlockRemoved", "CPU"), ("BlockRemoved", "STORAGE")}

pytestmark = pytest.mark.timeout(600)


class Subscriber:
    """A subscriber as vLLM 0.33's publisher expects one: SUB on the topic, and a DEALER to the replay socket for
    what it missed (a REQ socket reads one reply per request; the replay streams several)."""

    def __init__(self, port: int, replay_port: int) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.replay_port = replay_port
        self.replay = self.dealer(replay_port)

    def dealer(self, port: int) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{port}")
        return sock

    def receive(self, until_seq: int, timeout_ms: int = 5000) -> list[tuple[int, bytes]]:
        """Every published batch up to ``until_seq`` that reaches the SUB socket (the first ones may not: slow joiner)."""
        got = []
        while self.sub.poll(timeout_ms):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == TOPIC.encode()
            seq = int.from_bytes(seq_bytes, "big")
            got.append((seq, payload))
            if seq >= until_seq:
                break
        return got

    def replay_frames(self, start: int, sock: zmq.Socket | None = None) -> list[list[bytes]]:
        """Every frame a replay from ``start`` answers, up to and with the end marker ``[b"", -1, b""]``."""
        sock = sock or self.replay
        sock.send_multipart([b"", start.to_bytes(8, "big")])  # REQ's envelope: an empty delimiter first
        out = []
        while sock.poll(5000):
            empty, *frames = sock.recv_multipart()
            assert empty == b"" and len(frames) == 3, frames
            out.append(frames)
            if int.from_bytes(frames[1], "big", signed=True) == -1:
                assert frames[0] == frames[2] == b""
                return out
        raise AssertionError("the replay never ended with its end marker")

    def ask_replay(self, start: int) -> list[tuple[int, bytes]]:
        frames = self.replay_frames(start)[:-1]
        assert all(topic == TOPIC.encode() for topic, _, _ in frames)
        return [(int.from_bytes(seq, "big"), payload) for _, seq, payload in frames]

    def close(self) -> None:
        self.ctx.destroy(linger=0)


class VLLMDecoder:
    """vllm_kv_events.py in its process: decodes payloads with vLLM 0.33's structs and keeps vLLM's publisher of
    the decoded batches open at ``port``/``replay_port`` until :meth:`close`."""

    def __init__(self, payloads: list[bytes], tmp_path: Path, port: int, replay_port: int) -> None:
        assert (ANCHORS / "vllm").is_dir(), f"{ANCHORS} is missing vLLM: run `make setup` (vllm==0.33.0, --no-deps)"
        spec = tmp_path / "payloads.json"
        publish = {"endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay_port}", "topic": TOPIC}
        spec.write_text(json.dumps({"payloads": [p.hex() for p in payloads], "publish": publish}))
        self.process = subprocess.Popen([sys.executable, str(DECODER_SCRIPT), str(spec)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, "PYTHONPATH": str(ANCHORS)})
        self.decoded = self._line()
        self.published = self._line()["published"]

    def _line(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            self.process.kill()
            raise AssertionError(f"vllm_kv_events.py ended: {self.process.stderr.read()[-4000:]}")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(60)


# The older positional layout (vLLM's earlier documented subscriber, and this project's until vLLM 0.33): each
# event an array whose first item is its type, lora_name optional. For the control only.
class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


#: The old stored event: ours' first seven fields, positional, with lora_name optional.
OldBlockStored = msgspec.defstruct(
    "OldBlockStored", [*((name, get_type_hints(BlockStored)[name]) for name in BlockStored.__struct_fields__[:6]),
                       ("lora_name", str | None, None)], bases=(OldEvent,), tag="BlockStored")


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[OldBlockStored]
    data_parallel_rank: int | None = None


def prompts(count: int = 6, length: int = 5 * BLOCK + 3) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, 500) for _ in range(length)] for _ in range(count)]


def last_seq(llm: MegatronLLM) -> int:
    """The number of the last batch the engine's publisher was given."""
    return llm.engine.kv_events.seq_of(llm.engine.kv.publisher)


def holdings(batches: list[dict[str, Any]]) -> dict[str, set[int]]:
    """What each medium holds, replayed from the (vLLM-decoded) events alone."""
    held: dict[str, set[int]] = {}
    for batch in batches:
        for event in batch["events"]:
            if event["type"] == "AllBlocksCleared":
                held.clear()
            elif event["type"] == "BlockStored":
                assert len(event["token_ids"]) == len(event["block_hashes"]) * event["block_size"]
                held.setdefault(event["medium"], set()).update(event["block_hashes"])
            else:
                held.setdefault(event["medium"], set()).difference_update(event["block_hashes"])
    return held


def engine(model: str, **extra: Any) -> tuple[MegatronLLM, Subscriber]:
    port, replay_port = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
              "replay_endpoint": f"tcp://*:{replay_port}", "topic": TOPIC}
    settings = dict(block_size_tokens=BLOCK, num_kv_blocks=24, max_requests=2, max_batch_tokens=256,
                    kv_offloading_size=0.01, kv_events_config=config) | extra
    return MegatronLLM(model, InferenceConfig(**settings)), Subscriber(port, replay_port)


@pytest.fixture
def published(tiny_llama):
    llm, subscriber = engine(tiny_llama)
    yield llm, subscriber
    subscriber.close()
    llm.engine.shutdown()


@pytest.fixture
def tiered(tiny_llama, tmp_path):
    """An engine whose blocks go GPU -> CPU (eight host slots) -> STORAGE (a disk tier of twelve files), with a
    LoRA adapter beside the base model."""
    adapter = make_peft_adapter(tiny_llama, tmp_path / "adapter", rank=4, seed=3)
    llm, subscriber = engine(tiny_llama, kv_offloading_size=8 * 8192 / 2**30, kv_offloading_backend="disk",
                             kv_disk_dir=str(tmp_path / "disk"), kv_disk_size=12 * 8400 / 2**30, enable_lora=True,
                             max_loras=1, max_lora_rank=4, lora_modules={ADAPTER: str(adapter)})
    yield llm, subscriber
    subscriber.close()
    llm.engine.shutdown()


def test_vllm_033s_own_structs_decode_every_event_and_medium_and_say_what_each_tier_holds(tiered, tiny_llama,
                                                                                          tmp_path):
    llm, subscriber = tiered
    engine_ = llm.engine
    batch = prompts()
    adapted = SamplingParams(temperature=0.0, num_tokens_to_generate=4, ignore_eos=True, lora_name=ADAPTER)
    for _ in range(2):  # six prompts through a pool of two, each under the base and the adapter: blocks go down the
        for prompt in batch:  # tiers and come back up
            llm.generate([prompt], PARAMS)
            llm.generate([prompt], adapted)
    engine_.host_tier.flush()  # the spills queued so far are written
    engine_.host_tier.announce()  # and told to the event log
    engine_.kv_events.flush()
    before_refit = last_seq(llm)
    state = {"GPU": set(engine_.allocator._block_of_hash), "CPU": set(engine_.host_tier._slot_of_hash),
             "STORAGE": set(engine_.kv_events.holds("STORAGE"))}
    engine_.memory.refit(tiny_llama)  # new weights (the same ones, a new epoch): every tier forgets
    engine_.kv_events.flush()
    llm.generate([batch[0]], PARAMS)  # the new epoch's blocks carry other hashes
    last = last_seq(llm)

    received = dict(subscriber.receive(last))
    payloads = dict(subscriber.ask_replay(0)) | received  # the slow joiner's gap: the replay fills it
    assert sorted(payloads) == list(range(last + 1))
    ours = [payloads[seq] for seq in range(last + 1)]
    port, replay_port = free_port(), free_port()
    decoder = VLLMDecoder(ours, tmp_path, port, replay_port)
    try:
        decoded = decoder.decoded
        assert decoded["vllm"] == "0.33.0"
        batches = decoded["batches"]
        assert [b.get("error") for b in batches] == [None] * len(ours)  # every batch decodes with vLLM's structs
        assert all(b["same_bytes"] for b in batches)  # and vLLM encodes what it decoded into our very bytes
        assert {b["data_parallel_rank"] for b in batches} == {0}  # stamped as vLLM's publisher stamps it

        # vLLM's own publisher, handed the same batches, answers a replay with our frames exactly
        assert decoder.published == len(ours)
        theirs = subscriber.dealer(replay_port)
        frames = subscriber.replay_frames(0, theirs)
        for _ in range(50):  # its thread sends what it was handed in turn: until all of it is there
            if len(frames) == len(ours) + 1:
                break
            frames = subscriber.replay_frames(0, theirs)
        assert frames == subscriber.replay_frames(0)
    finally:
        decoder.close()

    events = [event for b in batches for event in b["events"]]
    assert {(e["type"], e["medium"]) for e in events if e["type"] != "AllBlocksCleared"} == TIERED
    assert all(e["group_idx"] == 0 for e in events if e["type"] != "AllBlocksCleared")
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert all("lora_name" in e for e in stored)  # vLLM 0.33 requires it: sent for the base model too, as None
    by_adapter = {name: {h for e in stored if e["lora_name"] == name for h in e["block_hashes"]}
                  for name in (None, ADAPTER)}
    assert {(e["lora_name"], e["lora_id"] is None) for e in stored} == {(None, True), (ADAPTER, False)}
    assert by_adapter[None] and by_adapter[ADAPTER] and not by_adapter[None] & by_adapter[ADAPTER]
    for prompt in batch:  # the chain a router computes from a prompt is the one the events name
        assert set(block_hashes(prompt[: 5 * BLOCK], BLOCK)) <= by_adapter[None]

    assert batches[0]["events"] == [{"type": "AllBlocksCleared"}]  # the start: nothing held
    held = holdings(batches[: before_refit + 1])
    assert held == state and state["STORAGE"] and state["CPU"] - state["GPU"]
    assert batches[before_refit + 1]["events"] == [{"type": "AllBlocksCleared"}]  # the refit
    after = {h for b in batches[before_refit + 2:] for e in b["events"] if e["type"] == "BlockStored"
             for h in e["block_hashes"]}
    assert after and not after & set(block_hashes(batch[0][: 5 * BLOCK], BLOCK))


def test_control_the_older_positional_layout_does_not_decode_with_vllm_033s_structs(tmp_path):
    old = msgspec.msgpack.encode(OldBatch(ts=1.0, events=[OldBlockStored([1], None, list(range(BLOCK)), BLOCK, None,
                                                                         "GPU")], data_parallel_rank=0))
    decoder = VLLMDecoder([old], tmp_path, free_port(), free_port())
    decoder.close()
    assert "Expected `object`, got `array`" in decoder.decoded["batches"][0]["error"]


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
