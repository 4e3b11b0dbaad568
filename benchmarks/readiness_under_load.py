"""How fast ``/ready`` and ``/health`` answer while the server streams to many clients (issue 38: within 100 ms at
any load), on the main port and on the probe port (``--health-port``).

Starts ``megatron-serve run`` (a tiny model unless ``--model``; ``--engines`` 2) with a probe port, opens
``--streams`` streamed completions of ``--tokens`` tokens each at once, and from a *separate process* (this
one's GIL and event loop are busy with the streams; a kubelet is not) probes ``/ready`` and ``/health`` on
both ports every ``--interval`` seconds, each probe with ``http.client`` on a new connection as a
Kubernetes probe makes it, from when a quarter of the streams have their first token until every stream
has ended; as a control, the same probe server in an idle process of its own (what the machine alone costs a
probe: scheduling on shared cores, the prober). Prints each probe's latency percentiles and how many were
not 200; the tests
(``tests/fleet/test_run_under_load.py``, ``tests/fleet/test_probe_port.py``) assert the 200s, this script
measures the time.

    python benchmarks/readiness_under_load.py                         # 400 streams of 64 tokens, 2 engines
    python benchmarks/readiness_under_load.py --streams 200 --run-args "--api-server-count 2"
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import multiprocessing
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from scratch import scratch_dir
from serving import THREAD_VARIABLES, percentile
from serving_stack import start_stack, stop_stack

MP = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of this one's load, threads or GIL
LOADED, DONE = MP.Event(), MP.Event()


PROBES = (("main", "/ready"), ("main", "/health"), ("probe port", "/ready"), ("probe port", "/health"),
          ("idle process", "/health"))


class _AlwaysUp:
    """The facts of the idle control: a process that does nothing but answer."""

    def health(self) -> tuple[int, dict[str, Any]]:
        return 200, {"status": "ok"}

    ready = health


def idle_prober_target(port_out: Any, done: Any) -> None:
    """The control: the probe port's server in a process of its own that does nothing else, so its latency is
    the machine's (scheduling on the shared cores, the prober), not the loaded server's; sends its port."""
    from megatron_serve.server.probe_port import ProbeServer  # noqa: PLC0415
    from megatron_serve.server.runner import bind_socket  # noqa: PLC0415

    server = ProbeServer(bind_socket("127.0.0.1", 0), _AlwaysUp())  # type: ignore[arg-type]
    port_out.put(server.port)
    done.wait()
    server.close()


def probe(port: int, path: str) -> tuple[int, float]:
    """One GET with ``http.client`` on a new connection: its status (0: no answer) and seconds."""
    began = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", path)
        answer = conn.getresponse()
        answer.read()
        status = answer.status
    except OSError:
        status = 0
    finally:
        conn.close()
    return status, time.perf_counter() - began


def probing(ports: dict[str, int], interval: float, loaded: Any, done: Any, results: Any) -> None:
    """In a process of its own: every probe of :data:`PROBES` every ``interval`` seconds (each on a thread, so that
    a slow one delays no other) from ``loaded`` until ``done``; the results go to the ``results`` queue."""
    futures: dict[tuple[str, str], list] = {key: [] for key in PROBES}
    with ThreadPoolExecutor(32) as pool:
        while not done.wait(interval):
            if loaded.is_set():
                for (where, path), found in futures.items():
                    found.append(pool.submit(probe, ports[where], path))
        results.put({key: [f.result() for f in found] for key, found in futures.items()})


async def one_stream(http: httpx.AsyncClient, model: str, number: int, tokens: int, first: asyncio.Event) -> int:
    """A streamed completion; its chunks with text."""
    body = {"model": model, "prompt": f"Load {number}: a b c d e", "max_tokens": tokens, "ignore_eos": True,
            "stream": True}
    chunks = 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunks += 1
                first.set()
    return chunks


async def load(url: str, model: str, streams: int, tokens: int) -> float:
    """Run the streams; returns the seconds they took, once a quarter of them had their first token (``loaded``)."""
    limits = httpx.Limits(max_connections=streams + 16, max_keepalive_connections=streams + 16)
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        firsts = [asyncio.Event() for _ in range(streams)]
        tasks = [asyncio.create_task(one_stream(http, model, i, tokens, first)) for i, first in enumerate(firsts)]
        while sum(first.is_set() for first in firsts) < streams // 4 and not all(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        LOADED.set()
        await asyncio.gather(*tasks)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: a tiny random model)")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--streams", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per stream")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between probes")
    parser.add_argument("--run-args", default="", help="extra `megatron-serve run` options")
    parser.add_argument("--threads", type=int, default=1, help="torch/OpenMP/BLAS threads of every process")
    args = parser.parse_args()
    for name, value in (("--streams", args.streams), ("--tokens", args.tokens), ("--engines", args.engines),
                        ("--threads", args.threads)):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    if args.interval <= 0:
        parser.error(f"--interval must be > 0, got {args.interval}")
    for name in THREAD_VARIABLES:
        os.environ[name] = str(args.threads)
    model_dir = args.model
    if model_dir is None:
        from megatron_serve.model.tiny import make_tiny_model  # noqa: PLC0415

        model_dir = str(make_tiny_model(scratch_dir("bench-tiny-") / "tiny-llama"))
    from megatron_serve.fleet.local_fleet import free_port  # noqa: PLC0415

    health_port = free_port("127.0.0.1")
    proc, url, _output = start_stack(model_dir, args.engines, f"{args.run_args} --health-port {health_port}")
    idle_port: Any = MP.Queue()
    idle = MP.Process(target=idle_prober_target, args=(idle_port, DONE), daemon=True)
    idle.start()
    ports = {"main": int(url.rsplit(":", 1)[1]), "probe port": health_port, "idle process": idle_port.get(timeout=60)}
    results: Any = MP.Queue()
    prober = MP.Process(target=probing, args=(ports, args.interval, LOADED, DONE, results), daemon=True)
    prober.start()
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        elapsed = asyncio.run(load(url, model, args.streams, args.tokens))
    finally:
        DONE.set()
        probes = results.get(timeout=120)
        prober.join(10)
        idle.join(10)
        stop_stack(proc)
    print(f"{args.streams} streams of {args.tokens} tokens, {args.engines} engine(s) {args.run_args}, "
          f"{THREAD_VARIABLES[0]}={args.threads}: {elapsed:.1f}s; probes every {args.interval}s from another "
          "process, on new connections, while they ran")
    print("| port | path | probes | not 200 | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|---|")
    for (where, path), found in probes.items():
        took = [seconds * 1000 for _status, seconds in found]
        bad = sum(status != 200 for status, _seconds in found)
        print(f"| {where} | {path} | {len(found)} | {bad} | {percentile(took, 50):.1f} | {percentile(took, 99):.1f} | "
              f"{max(took, default=float('nan')):.1f} |")
    if not any(probes.values()):
        sys.exit("no probe ran: the streams ended before a quarter of them had started")


if __name__ == "__main__":
    main()
