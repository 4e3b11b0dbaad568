"""The coordinator's own CPU per request, without sockets: the core plus the frame codec.

``coordinator_peer.py`` measures the whole coordinator process, ZeroMQ and the kernel included, on a
machine whose noise moves a run by 20% or more. This one replays the 64-in-flight load into a
:class:`~megatron_serve.coordinator.CoordinatorCore` in this process and times only what the
coordinator process would run for it: decoding each frame, the core's handling and dispatch, and
packing what it sends into BATCH frames. Peers are simulated here (their time is not counted): one
client keeping ``--in-flight`` requests submitted, ``--engines`` engines answering every request with
one token, ``--step-outputs`` outputs per ENGINE_STEP. Small changes show up here (a microsecond per
request) where the peer benchmark cannot resolve them.

    python benchmarks/coordinator_core.py                    # best and median of 5 rounds of 20,000
    python benchmarks/coordinator_core.py --profile          # cProfile of one round, by own time
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from typing import Any, Callable

import msgspec

from megatron_serve.coordinator import CoordinatorCore
from megatron_serve.coordinator.effects import Send
from megatron_serve.coordinator.loop import frames_by_peer
from megatron_serve.wire.handshake import PROTOCOL_VERSION
from megatron_serve.wire.messages import FROM_COORDINATOR, TO_COORDINATOR
from megatron_serve.wire.protocol import Header, Message, decode, encode, pack_batches, unbatch

PROMPT = [101, 2023, 2003, 1037, 3231, 102]
PARAMS = msgspec.msgpack.encode({"temperature": 0.0, "num_tokens_to_generate": 1, "ignore_eos": True})
CLIENT = b"client"


class Replay:
    """One coordinator core and its simulated peers; :meth:`run` returns requests finished."""

    def __init__(self, engines: int, in_flight: int, step_outputs: int, *, capacity: int = 128,
                 acks: bool = True, clock: Callable[[], float] = time.perf_counter) -> None:
        """``capacity``: each engine's (its HELLO); ``acks``: the client acknowledges results (without, the
        coordinator forgets a request as it delivers its result); ``clock``: what times the coordinator's share
        (``time.thread_time``: its CPU, without the time a loaded host runs other processes)."""
        self.core = CoordinatorCore()
        self.clock = clock
        self.in_flight = in_flight
        self.step_outputs = step_outputs
        self.engines = [b"engine-%d" % i for i in range(engines)]
        self.engine_ids: dict[bytes, str] = {}
        self.inbox: dict[bytes, list[bytes]] = {}
        self.seconds = 0.0  # the coordinator's share only
        self.submitted = 0
        self.coordinator(CLIENT, encode(Header.HELLO, {"role": "client", "client_id": "bench", "acks": acks,
                                                       "protocol": PROTOCOL_VERSION}))
        for group, engine in enumerate(self.engines):
            self.coordinator(engine, encode(Header.HELLO, {
                "role": "engine", "engine_group": group, "capacity": capacity, "info": {"kv_blocks_total": 1024},
                "protocol": PROTOCOL_VERSION}))
            self.engine_ids[engine] = self.received(engine)[0].body.engine_id
        self.inbox.clear()

    def coordinator(self, identity: bytes, frame: bytes) -> None:
        """What the coordinator process does with one frame (``loop.Coordinator``, sockets aside)."""
        started = self.clock()
        effects = self.core.on_message(identity, decode(frame, TO_COORDINATOR), 1000.0)
        for peer, frames in frames_by_peer([e for e in effects if isinstance(e, Send)]).items():
            self.inbox.setdefault(peer, []).extend(frames)
        self.seconds += self.clock() - started

    def received(self, peer: bytes) -> list[Message]:
        messages: list[Message] = []
        for frame in self.inbox.pop(peer, []):
            message = decode(frame, FROM_COORDINATOR)
            messages += (list(unbatch(message.body, FROM_COORDINATOR)) if message.header is Header.BATCH
                         else [message])
        return messages

    def submits(self, count: int, acks: list[Any]) -> list[bytes]:
        frames = []
        for _ in range(count):
            frames.append(encode(Header.SUBMIT, {"client_request_id": f"r{self.submitted}",
                                                 "prompt": [*PROMPT, self.submitted % 30000],
                                                 "sampling_params": msgspec.Raw(PARAMS)}))
            self.submitted += 1
        if acks:
            frames.append(encode(Header.RESULT_ACK, {"client_request_ids": acks}))
        return pack_batches(frames)

    def run(self, requests: int) -> int:
        finished = 0
        pending = self.submits(self.in_flight, [])
        while finished < requests:
            for frame in pending:
                self.coordinator(CLIENT, frame)
            for engine in self.engines:
                outputs = []
                for message in self.received(engine):
                    if message.header is Header.ENGINE_SUBMIT:
                        record = dict(msgspec.msgpack.decode(message.body.request), generated_tokens=[7],
                                      generated_text=" 7",
                                      status="COMPLETED", finish_reason="length", finish_time=time.time())
                        outputs.append(({"request_id": record["request_id"], "new_tokens": [7], "new_text": " 7",
                                         "finished": True}, record))
                for i in range(0, len(outputs), self.step_outputs):
                    part = outputs[i:i + self.step_outputs]
                    self.coordinator(engine, encode(Header.ENGINE_STEP, {
                        "engine_id": self.engine_ids[engine], "outputs": [delta for delta, _ in part],
                        "records": {delta["request_id"]: record for delta, record in part}}))
            acks = [m.body.client_request_id for m in self.received(CLIENT) if m.header is Header.RESULT]
            finished += len(acks)
            pending = self.submits(len(acks), acks)
        return finished


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20_000, help="per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--step-outputs", type=int, default=16, help="outputs per ENGINE_STEP frame")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    replay = Replay(args.engines, args.in_flight, args.step_outputs)
    replay.run(min(args.requests, 5000))  # warm-up
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(replay.run, args.requests)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return
    per_request = []
    for _ in range(args.rounds):
        replay.seconds = 0.0
        finished = replay.run(args.requests)
        per_request.append(replay.seconds / finished * 1e6)
    print(f"coordinator core + codec, {args.in_flight} in flight, {args.engines} engines: "
          f"best {min(per_request):.1f} us/request, median {statistics.median(per_request):.1f} "
          f"({' '.join(f'{v:.1f}' for v in per_request)})")


if __name__ == "__main__":
    main()
