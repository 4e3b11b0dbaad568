"""The coordinator at fleet scale: 10 to 1,000 simulated engines and 10^3 to 10^6 queued requests.

Grows ``coordinator_core.py``'s replay (the coordinator's core and frame codec in this process, every input a real
wire frame, decoded as the coordinator process decodes it; only the coordinator's share is timed) to sizes a fleet
past one machine reaches. Per size, in this order:

* **dispatch into an idle fleet**: one SUBMIT per input into engines that all have room, each input timed (its
  decoding, the request's admission and dispatch, the frame to its engine): p50/p99, which a scan of the engines
  would grow with the fleet;
* **admission**: one client submits every request, in BATCH frames of 256 SUBMITs; the engines' room fills at once
  and the rest waits: CPU per request admitted, and the process's memory per request held (RSS, after a
  collection);
* **heartbeats**: every engine sends one (with its running and waiting counts): CPU per heartbeat, and one STATUS
  of the whole fleet;
* **steady state**: the engines answer what they hold, ``--step-outputs`` requests per ENGINE_STEP, each finished
  with one token, and each step's freed room is dispatched from the head of the deep queue in the same input:
  CPU per request (its finish, its result, the dispatch of the next), and each step's handling time at p50/p99,
  the latency from a freed slot to its next request sent.

* **verbs** (``--verbs``): PAUSE, REFIT (its verify and load phases), SUSPEND, RESUME and UNPAUSE in turn, each from
  the client's frame to its CONTROL_ACK, every engine acknowledging each of its steps at once: the coordinator's time
  per verb, its fan-out to every engine and the acknowledgements' handling (``coordinator_peer.py --verbs`` times
  the same over ZeroMQ, against the real coordinator process).

The claim is the ratio from the smallest queue to the largest at 1,000 engines (docs/benchmarks.md). Simulated
engines answer at once: what is measured is the coordinator, not a model. Times are the coordinator thread's CPU by
default (``--clock cpu``): on a shared host the wall clock's p99 is the scheduler's (6-11 ms at a load of 8 on 2
cores, against 0.3 ms of CPU).

    python benchmarks/fleet_scale.py                                   # the table: 10/100/1,000 engines, 10^3-10^6
    python benchmarks/fleet_scale.py --engines 10 --queued 1000 --completions 2000   # the suite's smoke size
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from dataclasses import dataclass

import msgspec

from coordinator_core import CLIENT, Replay
from megatron_serve.coordinator.requests import Phase
from megatron_serve.wire.protocol import Header, encode

SUBMIT_BATCH = 256
CAPACITY = 8  # requests each simulated engine runs at once; the coordinator keeps 2x that on it (dispatch_factor)


@dataclass
class Row:
    engines: int
    queued: int  # requests waiting in the coordinator after admission
    dispatch_p50_us: float  # one SUBMIT into an idle fleet, dispatched
    dispatch_p99_us: float
    admit_us: float  # CPU per request admitted
    bytes_per_request: float  # RSS per request held
    heartbeat_us: float
    status_ms: float  # one STATUS of the whole fleet
    request_us: float  # steady state: CPU per request (finish, result, next dispatch)
    step_p50_ms: float
    step_p99_ms: float

    def line(self) -> str:
        return (f"| {self.engines:,} | {self.queued:,} | {self.dispatch_p50_us:.1f} | {self.dispatch_p99_us:.1f} | "
                f"{self.admit_us:.1f} | {self.bytes_per_request:,.0f} | "
                f"{self.heartbeat_us:.1f} | {self.status_ms:.1f} | {self.request_us:.1f} | {self.step_p50_ms:.3f} | "
                f"{self.step_p99_ms:.3f} |")


HEADER = ("| engines | queued | idle dispatch p50 us | idle dispatch p99 us | admission us/request | "
          "memory bytes/request | heartbeat us | STATUS ms | steady us/request | step p50 ms | step p99 ms |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def idle_dispatch(engines: int, requests: int, clock: str) -> tuple[float, float]:
    """p50 and p99 of one SUBMIT, each its own input, dispatched into a fleet whose engines all have room (seconds);
    the first, which files every engine that registered, is left out."""
    replay = Replay(engines, 0, 1, capacity=CAPACITY, acks=False, clock=CLOCKS[clock])
    times: list[float] = []
    for _ in range(min(requests, engines * CAPACITY) + 1):
        (frame,) = replay.submits(1, [])
        began = replay.seconds
        replay.coordinator(CLIENT, frame)
        times.append(replay.seconds - began)
    times = sorted(times[1:])
    return statistics.median(times), times[min(len(times) - 1, int(len(times) * 0.99))]


def measure(engines: int, total: int, completions: int, step_outputs: int, clock: str = "cpu") -> Row:
    """One size: ``engines`` engines, ``total`` requests submitted, ``completions`` finished in the steady state;
    ``clock``: ``cpu`` (the coordinator's thread's CPU time) or ``wall``."""
    dispatch_p50, dispatch_p99 = idle_dispatch(engines, 2_000, clock)
    replay = Replay(engines, 0, step_outputs, capacity=CAPACITY, acks=False, clock=CLOCKS[clock])
    core = replay.core
    gc.collect()
    before = rss()
    admit = submit_all(replay, total) / total
    gc.collect()
    held = len(core.flow.table)
    per_request = (rss() - before) / held
    queued = core.flow.table.count(Phase.QUEUED)
    held_by = {engine: _submitted(replay, engine) for engine in replay.engines}  # what admission sent each

    replay.seconds = 0.0
    for engine in replay.engines:
        replay.coordinator(engine, encode(Header.HEARTBEAT, {"running": CAPACITY, "waiting": CAPACITY,
                                                             "kv_blocks_free": 512, "kv_blocks_total": 1024}))
    heartbeat = replay.seconds / engines
    replay.seconds = 0.0
    replay.coordinator(CLIENT, encode(Header.STATUS, {"status_id": 1}))
    status = replay.seconds
    replay.inbox.clear()  # heartbeat answers and the STATUS reply

    replay.seconds = 0.0
    steps: list[float] = []
    done = 0
    while done < completions and any(held_by.values()):
        for engine in replay.engines:
            ids, held_by[engine] = held_by[engine][:step_outputs], held_by[engine][step_outputs:]
            if not ids:
                continue
            began = replay.seconds
            replay.coordinator(engine, encode(Header.ENGINE_STEP, {
                "engine_id": replay.engine_ids[engine],
                "outputs": [{"request_id": rid, "new_tokens": [7], "finished": True} for rid in ids],
                "records": {rid: {"request_id": rid, "status": "COMPLETED", "finish_reason": "length"}
                            for rid in ids}}))
            steps.append(replay.seconds - began)
            held_by[engine] += _submitted(replay, engine)
            done += len(ids)
        replay.inbox.pop(CLIENT, None)  # the results: the client's to read, not timed
    steps.sort()
    return Row(engines, queued, dispatch_p50 * 1e6, dispatch_p99 * 1e6, admit * 1e6, per_request, heartbeat * 1e6,
               status * 1e3, replay.seconds / done * 1e6, statistics.median(steps) * 1e3,
               steps[min(len(steps) - 1, int(len(steps) * 0.99))] * 1e3)


def submit_all(replay: Replay, total: int) -> float:
    """Submit ``total`` requests in BATCH frames of :data:`SUBMIT_BATCH`; the coordinator's seconds for them."""
    began = replay.seconds
    while replay.submitted < total:
        for frame in replay.submits(min(SUBMIT_BATCH, total - replay.submitted), []):
            replay.coordinator(CLIENT, frame)
    return replay.seconds - began


def measure_verbs(engines: int, queued: int, clock: str) -> dict[str, float]:
    """:func:`verb_times` at ``engines`` engines, each holding twice its capacity, with ``queued`` requests
    submitted (the rest wait in the coordinator)."""
    replay = Replay(engines, 0, CAPACITY, capacity=CAPACITY, acks=False, clock=CLOCKS[clock])
    submit_all(replay, queued)
    for engine in replay.engines:
        replay.received(engine)  # the requests dispatched: the engines hold them
    return verb_times(replay)


#: The verbs timed, in the order they run (each legal after the one before), and the state each engine reports.
VERBS: tuple[tuple[Header, dict[str, object], str], ...] = (
    (Header.PAUSE, {}, "PAUSED"),
    (Header.REFIT, {"source": "/weights/step-2"}, "PAUSED"),
    (Header.SUSPEND, {}, "SUSPENDED"),
    (Header.RESUME, {}, "PAUSED"),
    (Header.UNPAUSE, {}, "RUNNING"),
)


def verb_times(replay: Replay) -> dict[str, float]:
    """Each of :data:`VERBS`' completion time in the coordinator (seconds on the replay's clock): the client's verb,
    every engine's acknowledgement of each step it is sent (a REFIT's verify, then its load), to the client's
    CONTROL_ACK."""
    times: dict[str, float] = {}
    for number, (header, fields, state) in enumerate(VERBS):
        control_id = f"verb-{number}"
        began = replay.seconds
        replay.coordinator(CLIENT, encode(header, {"control_id": control_id, **fields}))
        while True:
            answered = [m for m in replay.received(CLIENT) if m.header in (Header.CONTROL_ACK, Header.ERROR)]
            if answered:
                break
            steps = 0
            for engine in replay.engines:
                for message in replay.received(engine):
                    if message.header is header:  # a step of the verb (others: requests sent after UNPAUSE)
                        steps += 1
                        replay.coordinator(engine, encode(Header.CONTROL_ACK, {
                            "control_id": message.body.control_id, "state": state,
                            "engine_id": replay.engine_ids[engine]}))
            if steps != len(replay.engines):
                raise RuntimeError(f"{header.name}: {steps} of {len(replay.engines)} engines were sent its step, "
                                   "and no answer came")
        if answered[0].header is Header.ERROR:
            raise RuntimeError(f"{header.name} refused: {answered[0].body.message}")
        times[header.name] = replay.seconds - began
    return times


def _submitted(replay: Replay, engine: bytes) -> list[str]:
    """The request ids the coordinator sent ``engine`` since the last look."""
    return [msgspec.msgpack.decode(m.body.request)["request_id"] for m in replay.received(engine)
            if m.header is Header.ENGINE_SUBMIT]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="10,100,1000", help="comma-separated engine counts")
    parser.add_argument("--queued", default="1000,100000,1000000",
                        help="comma-separated request counts (the largest only with the most engines)")
    parser.add_argument("--completions", type=int, default=32_000, help="requests finished in each steady state")
    parser.add_argument("--step-outputs", type=int, default=CAPACITY, help="requests finished per ENGINE_STEP")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                        help="what times the coordinator: its thread's CPU (default; a loaded host's other processes "
                             "left out) or the wall clock")
    parser.add_argument("--verbs", action="store_true",
                        help="also time PAUSE, REFIT, SUSPEND, RESUME and UNPAUSE at each engine count")
    parser.add_argument("--verbs-queued", type=int, default=100_000, help="requests submitted before the verbs")
    args = parser.parse_args()
    engine_counts = [int(v) for v in args.engines.split(",")]
    sizes = [int(v) for v in args.queued.split(",")]
    for name, values in (("--engines", engine_counts), ("--queued", sizes)):
        if not values or min(values) < 1:
            raise SystemExit(f"{name} needs positive counts, got {values}")
    print(f"clock: {args.clock}\n{HEADER}", flush=True)
    for engines in engine_counts:
        for total in sizes:
            if total == max(sizes) and engines != max(engine_counts) and len(sizes) > 1:
                continue  # the largest queue at the largest fleet only: the claim's row, in bounded time
            row = measure(engines, total, min(args.completions, total), args.step_outputs, args.clock)
            print(row.line(), flush=True)
    if args.verbs:
        names = [header.name for header, _, _ in VERBS]
        print(f"\nverbs, {args.verbs_queued:,} requests submitted: the coordinator's ms from the client's verb to its "
              f"CONTROL_ACK\n| engines | " + " | ".join(f"{n} ms" for n in names) + " |\n|---|"
              + "---|" * len(names), flush=True)
        for engines in engine_counts:
            times = measure_verbs(engines, args.verbs_queued, args.clock)
            print(f"| {engines:,} | " + " | ".join(f"{times[n] * 1e3:.1f}" for n in names) + " |", flush=True)


if __name__ == "__main__":
    main()
