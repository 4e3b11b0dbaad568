"""This project's coordinator against Megatron-LM's, side by side, with the same fake-engine load.

Both coordinators run in processes of their own; both fleets are ``--engines`` fake engines that
answer every request at once with one generated token (one process hosts all of them, a single
poll loop over one DEALER socket per engine, so the engines cost the same on both sides); both
clients run in this process. Megatron's side is megatron-core's own
``DataParallelInferenceCoordinator`` and ``InferenceClient`` (PyPI ``megatron-core``, imported
only here: ``pip install megatron-core==0.16.1``; it imports on CPU with torch, numpy and
packaging), its fake engines speaking its frames (``ENGINE_REPLY`` with serialized request
records, as ``DynamicInferenceEngine`` sends them). This project's side is
:class:`megatron_serve.coordinator.Coordinator` and :class:`megatron_serve.client.coordinator_client.InferenceClient`,
its fake engines speaking this project's frames (HELLO, heartbeats, ``ENGINE_STEP`` with the
finished record, as ``EngineProcess`` sends them). Prompts are token ids on both sides, so neither
coordinator tokenizes; Megatron's detokenizes every result (its design), with a tokenizer as
cheap as the text our fake engines attach.

At fleet scale (``--only ours --engines 1000``: issue 86) the one engines process holds a socket per engine, past
libzmq's default of 1,023 a context and the usual 1,024 open files (both raised here), each heartbeating every
second; ``--verbs`` then times PAUSE, REFIT (verify and load), SUSPEND, RESUME and UNPAUSE, every fake engine
acknowledging each step at once, over ``--verb-rounds`` rounds (``fleet_scale.py --verbs`` times the core alone).

Scenarios, each ``--requests`` requests: ``burst`` (all submitted at once), ``c64`` (64 in flight,
closed loop), ``c1`` (one at a time). Reported per coordinator and scenario: requests per second,
latency p50/p99 (submission to result, at the client) and the coordinator process's CPU time per
request (user + system, from /proc), then our/Megatron ratios; with ``--repeat`` also each run's
ratios and their median (this shared machine has slow spells that move one run's pair together).

    python benchmarks/coordinator_peer.py                  # 5,000 requests, 4 engines, all scenarios
    python benchmarks/coordinator_peer.py --only ours --scenarios c64 --profile /tmp/prof  # py-spy the coordinator
    python benchmarks/coordinator_peer.py --baseline insecure --repeat 5   # what the fleet secret costs
    python benchmarks/coordinator_peer.py --only ours --engines 1000 --verbs   # 1,000 engines, and the verbs there

``ours`` is a secure fleet, as every fleet is by default (a fleet secret: every connection CURVE-
encrypted, every peer proving the secret; ``megatron_serve.wire.security``); ``--baseline insecure``
compares it with the same coordinator started ``--insecure`` (plain TCP, no proof) instead of
Megatron's. Measured on the 2 shared CPU cores of the development machine (``--baseline insecure
--repeat 9 --requests-c1 1000``, 4 fake engines, 5,000 requests per scenario, load average 2.8-3.2):
the secure fleet's requests per second, as the median of the 9 runs' secure/insecure ratios (and the
ratio of the two sides' medians): 64 in flight 0.97x (0.95x: 15,908 against 16,756 req/s), burst
0.96x (0.99x), 1 in flight 0.92x (0.93x; p50 0.52 against 0.48 ms); coordinator CPU per request
1.00-1.08x. Encryption runs in libzmq's I/O threads and the batched frames amortize it; what is left
at 1 in flight is each message's box and the 0.6 us per frame of reading its connection's key.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import msgspec
import zmq

from megatron_serve.heap import freeze_startup_heap

CAPACITY = 128  # requests each of our fake engines accepts at once (a GPU engine's --max-num-seqs)
SCENARIOS = {"burst": None, "c64": 64, "c1": 1}
PROMPT = [101, 2023, 2003, 1037, 3231, 102]


# ----------------------------------------------------------------------------- shared helpers


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))]


@dataclass
class Row:
    side: str
    scenario: str
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_us: float  # coordinator CPU per request, microseconds


async def drive(submit: Callable[[int], Awaitable[Any]], requests: int, in_flight: int | None
                ) -> tuple[float, list[float]]:
    """Run ``requests`` submissions (all at once, or ``in_flight`` at a time); returns (seconds, latencies)."""
    latencies: list[float] = []

    async def one(i: int) -> None:
        started = time.perf_counter()
        await submit(i)
        latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    if in_flight is None:
        await asyncio.gather(*(one(i) for i in range(requests)))
    else:
        numbers = iter(range(requests))

        async def worker() -> None:
            for i in numbers:
                await one(i)

        await asyncio.gather(*(worker() for _ in range(in_flight)))
    return time.perf_counter() - started, latencies


async def measure(side: str, submit: Callable[[int], Awaitable[Any]], coordinator_pid: int,
                  args: argparse.Namespace) -> list[Row]:
    profile = start_py_spy(coordinator_pid, args.profile, args.profile_seconds)
    # Both clients share this process, and megatron-core imports torch: a million objects that every full
    # collection walks. Frozen, neither side's client pays for them (unfrozen, whichever side ran second
    # had its burst at 7,000 req/s instead of 15,000, and the first burst is always the second side's).
    freeze_startup_heap()
    rows = []
    await drive(submit, min(500, args.requests), 16)  # warm-up: connections, allocator, caches
    for name in args.scenarios:
        in_flight = SCENARIOS[name]
        requests = args.requests if in_flight != 1 else min(args.requests, args.requests_c1)
        spy = profile(f"{side}-{name}")
        cpu = cpu_seconds(coordinator_pid)
        seconds, latencies = await drive(submit, requests, in_flight)
        cpu = cpu_seconds(coordinator_pid) - cpu
        if spy is not None:
            spy.wait()
        rows.append(Row(side, name, requests / seconds, percentile(latencies, 50) * 1e3,
                        percentile(latencies, 99) * 1e3, cpu / requests * 1e6))
        print(f"  {side:<8} {name:<6} {rows[-1].rps:8.0f} req/s  p50 {rows[-1].p50_ms:6.2f} ms  "
              f"cpu {rows[-1].cpu_us:6.1f} us/req", file=sys.stderr)
    return rows


def end(*processes: Any) -> None:
    for proc in processes:
        proc.kill()
        proc.join()


def start_py_spy(pid: int, out_dir: str | None, seconds: float) -> Callable[[str], Any]:
    """A function that starts ``py-spy record`` on the coordinator for one scenario (or does nothing)."""
    def start(label: str) -> subprocess.Popen | None:
        if out_dir is None:
            return None
        os.makedirs(out_dir, exist_ok=True)
        return subprocess.Popen([shutil.which("py-spy", path=os.path.dirname(sys.executable)) or "py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)),
                                 "--rate", "500", "--format", "raw", "--output", f"{out_dir}/{label}.txt",
                                 "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return start


# ----------------------------------------------------------------------------- this project's side


def raise_open_files() -> None:
    """A coordinator of 1,000 engines holds a connection each, and their process a socket each: past the usual soft
    limit of 1,024 open files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))


def ours_coordinator(pipe: Any, secret: str | None) -> None:
    import logging

    from megatron_serve.coordinator import Coordinator, serve

    raise_open_files()
    logging.basicConfig(level=logging.ERROR)  # the insecure side warns, loudly
    coordinator = Coordinator(host="127.0.0.1", port=0, token=secret, insecure=secret is None)
    pipe.send(coordinator.bind())
    serve(coordinator)


def ours_engines(address: str, count: int, secret: str | None) -> None:
    """``count`` fake engines speaking this project's frames: every request finishes with one token at once."""
    from megatron_serve.wire.handshake import PROTOCOL_VERSION
    from megatron_serve.wire.messages import FROM_COORDINATOR
    from megatron_serve.wire.protocol import Header, decode, encode, unbatch
    from megatron_serve.wire.security import PeerKeys, fleet_secret, hello_credentials
    from megatron_serve.wire.transport import secure_client

    _verb_states()

    raise_open_files()
    ctx = zmq.Context()
    ctx.setsockopt(zmq.MAX_SOCKETS, count + 64)  # libzmq's default is 1,023 sockets a context
    socks, ids = [], {}
    poller = zmq.Poller()
    fleet = fleet_secret(secret)
    for group in range(count):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        keys = PeerKeys()
        secure_client(sock, fleet, keys)  # a secure fleet's engine link: CURVE, and the proof in HELLO
        sock.connect(address)
        sock.send(encode(Header.HELLO, {"role": "engine", "engine_group": group, "capacity": CAPACITY,
                                        "info": {"kv_blocks_total": 1024}, "protocol": PROTOCOL_VERSION,
                                        **hello_credentials(fleet, keys)}))
        socks.append(sock)
        poller.register(sock, zmq.POLLIN)
    last_beat, progress = 0.0, 0
    while True:
        now = time.monotonic()
        if now - last_beat > 1.0:
            last_beat = now
            for sock in socks:
                if sock in ids:
                    sock.send(encode(Header.HEARTBEAT, {"engine_id": ids[sock], "progress": progress}))
        for sock, _ in poller.poll(200):
            progress += 1
            outputs, records = [], {}
            while True:
                try:
                    message = decode(sock.recv(zmq.NOBLOCK), FROM_COORDINATOR)
                except zmq.Again:
                    break
                for header, body in (unbatch(message.body, FROM_COORDINATOR) if message.header is Header.BATCH
                                     else (message,)):
                    if header is Header.HELLO_ACK:
                        ids[sock] = body.engine_id
                    elif header in VERB_STATES:  # a lifecycle step: done at once, in the state it leads to
                        sock.send(encode(Header.CONTROL_ACK, {"control_id": body.control_id,
                                                              "state": VERB_STATES[header], "engine_id": ids[sock]}))
                    elif header is Header.ENGINE_SUBMIT:
                        record = msgspec.msgpack.decode(body.request)  # an EngineRequest, as engines decode it
                        record.update(generated_tokens=[7], generated_text=" 7", status="COMPLETED",
                                      finish_reason="length", first_token_time=time.time(), finish_time=time.time())
                        outputs.append({"request_id": record["request_id"], "new_tokens": [7], "new_text": " 7",
                                        "finished": True})
                        records[record["request_id"]] = record
            if outputs:
                sock.send(encode(Header.ENGINE_STEP, {"engine_id": ids[sock], "outputs": outputs, "records": records}))


async def run_ours(args: argparse.Namespace, secure: bool = True) -> list[Row]:
    """This project's side: a secure fleet, or (``secure=False``) the same started ``--insecure``."""
    from megatron_serve.client.coordinator_client import InferenceClient
    from megatron_serve.wire.sampling_params import SamplingParams
    from megatron_serve.wire.security import make_secret

    secret = make_secret() if secure else None
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    coordinator = ctx.Process(target=ours_coordinator, args=(child, secret), daemon=True)
    coordinator.start()
    address = parent.recv()
    engines = ctx.Process(target=ours_engines, args=(address, args.engines, secret), daemon=True)
    engines.start()
    client = InferenceClient(address, token=secret)
    try:
        await client.start(timeout=60)
        started = time.perf_counter()
        await client.wait_for_engines(args.engines, timeout=60 + args.engines * 0.5, poll=0.05)
        print(f"  {args.engines} engines registered in {time.perf_counter() - started:.1f}s", file=sys.stderr)
        params = SamplingParams(temperature=0.0, num_tokens_to_generate=1, ignore_eos=True)

        async def submit(i: int) -> Any:
            result = await client.add_request([*PROMPT, i % 30000], params)
            if result.status.value != "COMPLETED":
                raise RuntimeError(f"request failed: {result.error}")
            return result

        rows = await measure("ours" if secure else "insecure", submit, coordinator.pid, args)
        if args.verbs and secure:
            for _ in range(args.verb_rounds):
                VERB_TIMES.append(await verb_times(client, coordinator.pid, args.engines))
        return rows
    finally:
        client.close()
        end(engines, coordinator)


#: What a fake engine reports after each lifecycle step: the state it leads to (a REFIT keeps the fleet's).
VERB_STATES: dict[Any, str] = {}
#: The verbs timed, in an order in which each is legal; their wall-clock times, one dict per run.
VERB_ORDER = ("PAUSE", "REFIT", "SUSPEND", "RESUME", "UNPAUSE")
VERB_TIMES: list[dict[str, float]] = []


def _verb_states() -> None:
    from megatron_serve.wire.protocol import Header

    VERB_STATES.update({Header.PAUSE: "PAUSED", Header.REFIT: "PAUSED", Header.SUSPEND: "SUSPENDED",
                        Header.RESUME: "PAUSED", Header.UNPAUSE: "RUNNING"})


async def verb_times(client: Any, coordinator_pid: int, engines: int, idle_window: float = 3.0
                     ) -> dict[str, float]:
    """Each verb of :data:`VERB_ORDER`, from the client's call to the fleet's acknowledgement (wall seconds, under
    its name), every engine acknowledging each step at once; and the coordinator process's CPU seconds for it
    (``NAME cpu``), less what its idle fleet's heartbeats cost over the same time (measured over ``idle_window``
    seconds first: 1,000 engines send 1,000 a second)."""
    timeout = 60.0
    calls = {"PAUSE": lambda: client.pause(timeout=timeout), "REFIT": lambda: client.refit("/weights/step-2",
                                                                                         timeout=timeout),
             "SUSPEND": lambda: client.suspend(timeout=timeout), "RESUME": lambda: client.resume(timeout=timeout),
             "UNPAUSE": lambda: client.unpause(timeout=timeout)}
    times: dict[str, float] = {}
    cpu = cpu_seconds(coordinator_pid)
    await asyncio.sleep(idle_window)
    idle = (cpu_seconds(coordinator_pid) - cpu) / idle_window  # CPU seconds a second
    for name in VERB_ORDER:
        cpu, started = cpu_seconds(coordinator_pid), time.perf_counter()
        ack = await calls[name]()
        times[name] = time.perf_counter() - started
        times[f"{name} cpu"] = max(0.0, cpu_seconds(coordinator_pid) - cpu - idle * times[name])
        if ack.get("detail", {}).get("unresponsive"):
            raise RuntimeError(f"{name}: engines did not acknowledge: {ack['detail']['unresponsive']}")
    status = await client.status()
    if status["state"] != "RUNNING" or len(status["engines"]) != engines:
        raise RuntimeError(f"after the verbs: {status['state']} with {len(status['engines'])} of {engines} engines")
    return times


# ----------------------------------------------------------------------------- Megatron's side


def _cpu_nvtx() -> None:
    """megatron-core marks its (de)serialization with ``torch.cuda.nvtx`` ranges, which raise on a CPU build of
    torch; without a profiler attached they cost next to nothing on a GPU build, so here they do nothing."""
    import torch

    torch.cuda.nvtx.range_push = lambda *_args, **_kwargs: None
    torch.cuda.nvtx.range_pop = lambda *_args, **_kwargs: None


class _CheapTokenizer:
    """Megatron's coordinator detokenizes every result; this costs what our fakes' attached text costs."""

    def detokenize(self, tokens: list[int]) -> str:
        return " " + " ".join(map(str, tokens))


def megatron_coordinator(pipe: Any, ready: Any, engines: int) -> None:
    from megatron.core.inference.data_parallel_inference_coordinator import DataParallelInferenceCoordinator

    DataParallelInferenceCoordinator.entrypoint(pipe, ready, engines, _CheapTokenizer())


def megatron_engines(address: str, count: int) -> None:
    """``count`` fake engines speaking Megatron's frames: one ``ENGINE_REPLY`` per poll with every finished record."""
    import msgpack
    import torch
    from megatron.core.inference.headers import Headers
    from megatron.core.inference.inference_request import (DynamicInferenceRequest, DynamicInferenceRequestRecord,
                                                            Status)
    from megatron.core.inference.sampling_params import SamplingParams

    _cpu_nvtx()
    # One real record, serialized the engine's way, as the template of every reply (the engine's own
    # serialization cost stays out of the measurement, as on our side).
    request = DynamicInferenceRequest(request_id=0, prompt_tokens=torch.tensor(PROMPT),
                                      sampling_params=SamplingParams(num_tokens_to_generate=1))
    request.generated_tokens = [7]
    request.status = Status.COMPLETED
    template = DynamicInferenceRequestRecord.from_request(request).serialize()
    ctx = zmq.Context()
    socks = []
    poller = zmq.Poller()
    for rank in range(count):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"mp-coord-{rank}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send(b"")  # registration, as DynamicInferenceEngine does
        socks.append(sock)
        poller.register(sock, zmq.POLLIN)
    while True:
        for sock, _ in poller.poll(200):
            replies = []
            while True:
                try:
                    data = msgpack.unpackb(sock.recv(zmq.NOBLOCK), raw=False)
                except zmq.Again:
                    break
                header = Headers(data[0])
                if header is Headers.SUBMIT_REQUEST:
                    request_id, prompt, _params = data[1:]
                    inner = dict(template["requests"][0], request_id=request_id, prompt_tokens=("tensor", prompt))
                    replies.append({**template, "requests": [inner]})
                elif header is Headers.PAUSE:
                    sock.send(msgpack.packb([Headers.PAUSE_ACK.value], use_bin_type=True))
                elif header is Headers.STOP:
                    sock.send(msgpack.packb([Headers.STOP_ACK.value], use_bin_type=True))
            if replies:
                sock.send(msgpack.packb([Headers.ENGINE_REPLY.value, replies], use_bin_type=True))


async def run_megatron(args: argparse.Namespace) -> list[Row]:
    from megatron.core.inference.inference_client import InferenceClient
    from megatron.core.inference.sampling_params import SamplingParams

    _cpu_nvtx()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    ready = ctx.Event()
    coordinator = ctx.Process(target=megatron_coordinator, args=(child, ready, args.engines), daemon=True)
    coordinator.start()
    address = parent.recv()  # sent before it waits for its engines
    engines = ctx.Process(target=megatron_engines, args=(address, args.engines), daemon=True)
    engines.start()
    if not ready.wait(120):
        raise RuntimeError("Megatron's coordinator did not see its engines register")
    client = InferenceClient(address)
    try:
        await client.start()
        params = SamplingParams(temperature=0.0, num_tokens_to_generate=1)

        async def submit(i: int) -> Any:
            return await client.add_request([*PROMPT, i % 30000], params)

        return await measure("megatron", submit, coordinator.pid, args)
    finally:
        client.stop()
        end(engines, coordinator)


# ----------------------------------------------------------------------------- report


def paired_ratios(rows: list[Row], baseline: str) -> None:
    """Each run's ours/baseline ratios (the two sides of a run ran back to back) and their median:
    a slow spell of this shared machine moves one run's pair together, not the whole comparison."""
    scenarios = [s for s in SCENARIOS if any(r.scenario == s for r in rows)]
    runs: dict[str, list[tuple[float, float, float]]] = {s: [] for s in scenarios}
    for s in scenarios:
        ours = [r for r in rows if r.side == "ours" and r.scenario == s]
        theirs = [r for r in rows if r.side == baseline and r.scenario == s]
        runs[s] = [(o.rps / t.rps, o.p50_ms / t.p50_ms, o.cpu_us / t.cpu_us) for o, t in zip(ours, theirs)]
    if not any(runs.values()):
        return
    print()
    print(f"ours / {baseline} within each run: the median, then each run's")
    for s, ratios in runs.items():
        if ratios:
            rps = " ".join(f"{r[0]:.2f}" for r in ratios)
            cpu = " ".join(f"{r[2]:.2f}" for r in ratios)
            print(f"{s:<8} req/s {statistics.median(r[0] for r in ratios):.2f}x ({rps})   "
                  f"CPU/req {statistics.median(r[2] for r in ratios):.2f}x ({cpu})")


def report(rows: list[Row], baseline: str) -> None:
    header = f"{'coordinator':<12} {'scenario':<8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU us/req':>11}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row.side:<12} {row.scenario:<8} {row.rps:>8.0f} {row.p50_ms:>8.2f} {row.p99_ms:>8.2f} "
              f"{row.cpu_us:>11.1f}")
    by_key = {(r.side, r.scenario): r for r in rows}
    scenarios = [s for s in SCENARIOS if ("ours", s) in by_key and (baseline, s) in by_key]
    if scenarios:
        print()
        print(f"{'ours / ' + baseline:<21} {'req/s':>8} {'p50':>8} {'CPU/req':>8}")
        for s in scenarios:
            ours, theirs = by_key[("ours", s)], by_key[(baseline, s)]
            print(f"{s:<21} {ours.rps / theirs.rps:>7.2f}x {ours.p50_ms / theirs.p50_ms:>7.2f}x "
                  f"{ours.cpu_us / theirs.cpu_us:>7.2f}x")


async def main(args: argparse.Namespace) -> None:
    load_before = os.getloadavg()[0]
    rows: list[Row] = []
    for _ in range(args.repeat):
        if args.only in (None, "baseline"):
            rows += await (run_megatron(args) if args.baseline == "megatron" else run_ours(args, secure=False))
        if args.only in (None, "ours"):
            rows += await run_ours(args)
    runs = rows
    if args.repeat > 1:  # the median of each measurement over the repeats
        merged = []
        for key in dict.fromkeys((r.side, r.scenario) for r in rows):
            group = [r for r in rows if (r.side, r.scenario) == key]
            merged.append(Row(*key, *(statistics.median(getattr(r, f) for r in group)
                                      for f in ("rps", "p50_ms", "p99_ms", "cpu_us"))))
        rows = merged
    print(f"{args.engines} fake engines, {args.requests} requests per scenario "
          f"({args.requests_c1} at 1 in flight), median of {args.repeat} run(s); load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after on {os.cpu_count()} CPUs "
          "(latency at 1 in flight depends on it)")
    report(rows, args.baseline)
    if args.repeat > 1:
        paired_ratios(runs, args.baseline)
    if VERB_TIMES:
        print(f"\nverbs at {args.engines} fake engines (ours), {len(VERB_TIMES)} rounds: wall ms from the call to the "
              "acknowledgement (median), and the coordinator process's CPU ms for it (mean: /proc counts 10 ms ticks; "
              "its idle heartbeats' share taken out)")
        print("| | " + " | ".join(VERB_ORDER) + " |\n|" + "---|" * (len(VERB_ORDER) + 1))
        for label, suffix, average in (("wall ms", "", statistics.median), ("coordinator CPU ms", " cpu",
                                                                           statistics.mean)):
            print(f"| {label} | " + " | ".join(f"{average(t[name + suffix] for t in VERB_TIMES) * 1e3:.1f}"
                                             for name in VERB_ORDER) + " |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--requests-c1", type=int, default=2000, help="requests at 1 in flight (they take longest)")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--scenarios", default="burst,c64,c1", type=lambda s: s.split(","))
    parser.add_argument("--repeat", type=int, default=1, help="runs of everything; the table shows medians")
    parser.add_argument("--baseline", choices=("megatron", "insecure"), default="megatron",
                        help="what ours is compared with: Megatron's coordinator, or ours started --insecure")
    parser.add_argument("--only", choices=("ours", "baseline"), default=None)
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="py-spy the coordinator during each scenario (raw collapsed stacks in DIR)")
    parser.add_argument("--profile-seconds", type=float, default=3.0)
    parser.add_argument("--verbs", action="store_true",
                        help="ours: also time PAUSE, REFIT, SUSPEND, RESUME and UNPAUSE after the scenarios")
    parser.add_argument("--verb-rounds", type=int, default=5, help="rounds of the five verbs (--verbs)")
    args = parser.parse_args()
    for name in ("engines", "verb_rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} needs a positive count, got {getattr(args, name)}")
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(sorted(unknown))}; choose from {', '.join(SCENARIOS)}")
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
