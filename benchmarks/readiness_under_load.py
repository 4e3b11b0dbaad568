"""How fast ``/ready`` and ``/health`` answer while the server streams to many clients (issue 38: within 100 ms at
any load).

Starts ``megatron-serve run`` (a tiny model unless ``--model``; ``--engines`` 2), opens ``--streams`` streamed
completions of ``--tokens`` tokens each at once, and from a thread of its own (the streams keep this
process's event loop busy) probes ``/ready`` and ``/health`` every ``--interval`` seconds, each probe on a new
connection as a Kubernetes probe makes it, from when a quarter of the streams have their first token until
every stream has ended. Prints the probes' latency percentiles and how many were not 200; the acceptance
test (``tests/fleet/test_run_under_load.py``) asserts the 200s, this script measures the time.

    python benchmarks/readiness_under_load.py                         # 400 streams of 64 tokens, 2 engines
    python benchmarks/readiness_under_load.py --streams 200 --run-args "--api-server-count 2"
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from serving import THREAD_VARIABLES, percentile, start_stack, stop_stack


def probe(url: str, path: str) -> tuple[int, float]:
    """One GET on a new connection: its status and seconds."""
    began = time.perf_counter()
    try:
        status = httpx.get(f"{url}{path}", timeout=60).status_code
    except httpx.HTTPError:
        status = 0
    return status, time.perf_counter() - began


def probing(url: str, interval: float, loaded: threading.Event, done: threading.Event) -> dict[str, list]:
    """``/ready`` and ``/health`` every ``interval`` seconds from ``loaded`` until ``done``."""
    futures: dict[str, list] = {"/ready": [], "/health": []}
    with ThreadPoolExecutor(16) as pool:
        while not done.wait(interval):
            if loaded.is_set():
                for path, found in futures.items():
                    found.append(pool.submit(probe, url, path))
        return {path: [f.result() for f in found] for path, found in futures.items()}


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


async def load(url: str, model: str, streams: int, tokens: int, interval: float) -> tuple[dict[str, list], float]:
    limits = httpx.Limits(max_connections=streams + 16, max_keepalive_connections=streams + 16)
    loaded, done = threading.Event(), threading.Event()
    probes = asyncio.ensure_future(asyncio.to_thread(probing, url, interval, loaded, done))
    started = time.perf_counter()
    try:
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
            firsts = [asyncio.Event() for _ in range(streams)]
            tasks = [asyncio.create_task(one_stream(http, model, i, tokens, first)) for i, first in enumerate(firsts)]
            while sum(first.is_set() for first in firsts) < streams // 4 and not all(t.done() for t in tasks):
                await asyncio.sleep(0.05)
            loaded.set()
            await asyncio.gather(*tasks)
    finally:
        done.set()
    return await probes, time.perf_counter() - started


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

        model_dir = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="bench-tiny-")) / "tiny-llama"))
    proc, url, _output = start_stack(model_dir, args.engines, args.run_args)
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        probes, elapsed = asyncio.run(load(url, model, args.streams, args.tokens, args.interval))
    finally:
        stop_stack(proc)
    print(f"{args.streams} streams of {args.tokens} tokens, {args.engines} engine(s) {args.run_args}: "
          f"{elapsed:.1f}s; probes every {args.interval}s on new connections while they ran")
    print("| path | probes | not 200 | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|")
    for path, results in probes.items():
        took = [seconds * 1000 for _status, seconds in results]
        bad = sum(status != 200 for status, _seconds in results)
        print(f"| {path} | {len(results)} | {bad} | {percentile(took, 50):.1f} | {percentile(took, 99):.1f} | "
              f"{max(took, default=float('nan')):.1f} |")
    if not any(probes.values()):
        sys.exit("no probe ran: the streams ended before a quarter of them had started")


if __name__ == "__main__":
    main()
