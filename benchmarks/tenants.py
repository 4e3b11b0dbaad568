"""Tenants on a whole stack (`megatron-serve run`: HTTP server, coordinator, engine; docs/tenants.md), four figures:

1. **flood**: tenant `bulk` keeps 4x the fleet's request slots of long streamed completions in flight; tenant
   `chat` sends short requests one after another. `chat`'s TTFT p50/p99 alone, under the flood with `bulk`
   `sheddable` and `chat` `standard`, and (the control) under the flood with both `standard`; and `bulk`'s tokens/s
   meanwhile (it must progress). Shedding is off here (`--shed-* 0`): the figure is the scheduling's.
2. **crowd**: a hostile flood of ``--connections`` (200) streams of tenant ``bulk``, from a process of its own, each
   sent again at once when it ends or is refused; tenant ``chat`` (``critical``) sends short requests one after
   another. ``chat``'s TTFT p50/p99 alone and under the flood, in pairs on one stack (alone, flood, alone, flood...:
   ``--pairs``), so that a shared host's load moves both halves of a pair; its mean queue time (``/metrics``) in each
   half splits its TTFT into the queues' part and the rest. Rows: ``bulk`` ``sheddable`` with shedding on (its
   refusals come straight back) and off, ``bulk`` ``standard``, and the control with both ``standard``.
3. **weights**: tenants of weight 1 and 3 in one class, each with twice the slots in flight; the tokens each was
   streamed over the window, and their ratio.
4. **overhead**: no tenants, 64 streams (`benchmarks/serving.py`'s workload): CPU seconds of the server, the
   coordinator and the engine per request, this tree against ``--baseline DIR`` (a checkout of the tree before
   tenants; its ``runtime`` goes first on the stack's ``PYTHONPATH``), alternated ``--repeats`` times.

    python benchmarks/tenants.py                                  # flood, weights, overhead on a new tiny model
    python benchmarks/tenants.py --only crowd --requests 100 --no-control   # the 200-connection flood
    python benchmarks/tenants.py --only overhead --baseline /tmp/before --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import aiohttp

from scratch import scratch_dir
from serving import completion_messages, percentile
from serving_stack import stack_cpu_seconds, start_stack, stop_stack

SLOTS = 8  # the engine's request slots (--max-requests)
MODEL_NAME = ["tiny-llama"]  # the served name: the model directory's
NO_SHEDDING = "--shed-queue-depth 0 --shed-kv-cache-usage 0 --shed-stale-after 0"


def document(tenants: dict[str, dict]) -> str:
    """A key document: each tenant's key is ``key-<name>``."""
    return json.dumps({"tenants": tenants, "keys": [{"key": f"key-{name}", "tenant": name} for name in tenants]})


async def stream(http: aiohttp.ClientSession, key: str, prompt: list[int], tokens: int,
                 counted: dict[str, int] | None = None) -> float:
    """One streamed completion; its TTFT. ``counted``: tokens generated, by key (each request's when it ends)."""
    body = {"model": MODEL_NAME[0], "prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = None
    async for message in completion_messages(http, body, {"Authorization": f"Bearer {key}"}):
        if message.get("usage") and counted is not None:  # every token, whatever its text
            counted[key] = counted.get(key, 0) + message["usage"]["completion_tokens"]
        if message["choices"] and message["choices"][0].get("text"):
            first = first or time.perf_counter()
    return (first or time.perf_counter()) - started


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 500) for _ in range(length)] for _ in range(count)]


async def closed_loop(url: str, key: str, concurrency: int, tokens: int, stop: asyncio.Event,
                      counted: dict[str, int]) -> None:
    """``concurrency`` streams of ``key`` in flight until ``stop``."""
    work = prompts(4096, 32, 11)  # every tenant the same prompts
    async with aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=concurrency + 2)) as http:
        async def worker(index: int) -> None:
            turn = index
            while not stop.is_set():
                await stream(http, key, work[turn % len(work)], tokens, counted)
                turn += concurrency

        workers = [asyncio.ensure_future(worker(i)) for i in range(concurrency)]
        await stop.wait()
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)


def crowd_process(url: str, key: str, connections: int, tokens: int, stop, counted, refused) -> None:
    """A hostile flood in a process of its own (its event loop never delays the measured client's): ``connections``
    streams of ``key`` until ``stop`` is set, each sent again at once when it ends or is refused (a 503 or 429 is
    counted in ``refused``, and not waited out). ``counted``: the tokens streamed."""
    async def flood() -> None:
        work = prompts(4096, 32, 11)
        async with aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=600),
                                         connector=aiohttp.TCPConnector(limit=connections + 2)) as http:
            async def worker(index: int) -> None:
                turn, local = index, {}
                while not stop.is_set():
                    try:
                        await stream(http, key, work[turn % len(work)], tokens, local)
                    except RuntimeError:
                        with refused.get_lock():
                            refused.value += 1
                        await asyncio.sleep(0)
                    with counted.get_lock():
                        counted.value += local.pop(key, 0)
                    turn += connections

            workers = [asyncio.ensure_future(worker(i)) for i in range(connections)]
            while not stop.is_set():
                await asyncio.sleep(0.1)
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    asyncio.run(flood())


async def chat_ttfts(target: str | aiohttp.ClientSession, count: int) -> list[float]:
    """``chat``'s ``count`` requests of 8 tokens, one after another, at a URL or through a session; their TTFTs."""
    if isinstance(target, aiohttp.ClientSession):
        return [await stream(target, "key-chat", prompt, 8) for prompt in prompts(count, 32, 7)]
    async with aiohttp.ClientSession(base_url=target, timeout=aiohttp.ClientTimeout(total=600)) as http:
        return await chat_ttfts(http, count)


async def flood_level(url: str, requests: int) -> tuple[list[float], float]:
    """``chat``'s TTFTs under ``bulk``'s flood, and ``bulk``'s tokens/s meanwhile."""
    stop, counted = asyncio.Event(), {}
    flood = asyncio.ensure_future(closed_loop(url, "key-bulk", 4 * SLOTS, 256, stop, counted))
    await asyncio.sleep(3.0)  # the flood fills every slot and queue
    before, started = counted.get("key-bulk", 0), time.perf_counter()
    ttfts = await chat_ttfts(url, requests)
    rate = (counted.get("key-bulk", 0) - before) / (time.perf_counter() - started)
    stop.set()
    await flood
    return ttfts, rate


def with_stack(model: str, run_args: str, body, env: dict[str, str] | None = None):
    """``body(url, pid)``'s result, run against a stack started for it (``env``: the stack's extra variables)."""
    proc, url, _ = start_stack(model, 1, run_args) if env is None else _start_with(model, run_args, env)
    try:
        return asyncio.run(body(url, proc.pid))
    finally:
        stop_stack(proc)


def _start_with(model: str, run_args: str, env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return start_stack(model, 1, run_args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def key_file(text: str) -> str:
    path = scratch_dir("bench-tenants-") / "keys.json"
    path.write_text(text)
    return str(path)


def run_flood(model: str, requests: int) -> None:
    base = f"--max-requests {SLOTS} {NO_SHEDDING}"
    alone_doc = key_file(document({"bulk": {"class": "sheddable"}, "chat": {"class": "standard"}}))
    same_doc = key_file(document({"bulk": {"class": "standard"}, "chat": {"class": "standard"}}))
    alone = with_stack(model, f"{base} --api-key-file {alone_doc}", lambda url, _: chat_ttfts(url, requests))
    bands, bulk_rate = with_stack(model, f"{base} --api-key-file {alone_doc}",
                                  lambda url, _: flood_level(url, requests))
    same, same_rate = with_stack(model, f"{base} --api-key-file {same_doc}", lambda url, _: flood_level(url, requests))
    print(f"\nflood: bulk keeps {4 * SLOTS} streams of 256 tokens in flight ({SLOTS} slots); chat: {requests} "
          "requests of 8 tokens, one after another")
    print("| chat's TTFT | p50 (s) | p99 (s) | p99 / alone | bulk tokens/s |\n|---|---|---|---|---|")
    p99 = percentile(alone, 99)
    for name, values, rate in (("alone", alone, None), ("flood, bulk sheddable", bands, bulk_rate),
                               ("flood, both standard (control)", same, same_rate)):
        print(f"| {name} | {percentile(values, 50):.3f} | {percentile(values, 99):.3f} | "
              f"{percentile(values, 99) / p99:.2f} | {'' if rate is None else f'{rate:.0f}'} |")


async def fleet_gauges(http: aiohttp.ClientSession) -> dict[str, float]:
    """From ``/metrics`` (no key): the fleet's requests running and waiting, and ``chat``'s queue time (arrival at
    the coordinator to first scheduled: its sum and count), which splits its TTFT into the queues' part and the
    rest (HTTP, the step, the way back)."""
    async with http.get("/metrics") as response:
        text = await response.text()
    gauges = {"running": 0.0, "waiting": 0.0, "queue_sum": 0.0, "queue_count": 0.0}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("vllm:num_requests_running"):
            gauges["running"] += float(value)
        elif name.startswith("vllm:num_requests_waiting"):
            gauges["waiting"] += float(value)
        elif 'tenant="chat"' in name:
            for part in ("sum", "count"):
                if name.startswith(f"megatron_serve_tenant_request_queue_time_seconds_{part}"):
                    gauges[f"queue_{part}"] = float(value)
    return gauges


async def until(http: aiohttp.ClientSession, holds: Callable[[dict[str, float]], bool], timeout: float,
                what: str) -> dict[str, float]:
    """Poll ``/metrics`` until ``holds(gauges)``; the gauges then."""
    deadline = time.monotonic() + timeout
    while not holds(gauges := await fleet_gauges(http)):
        if time.monotonic() > deadline:
            raise SystemExit(f"the stack was not {what} after {timeout:g}s: {gauges}")
        await asyncio.sleep(0.1)
    return gauges


@dataclass
class Pair:
    """One alone phase and the flood phase after it, on one stack: ``chat``'s TTFTs, its mean queue time (s) in
    each, the flood's tokens/s and refusals, and the host's load average over the pair."""

    alone: list[float]
    flood: list[float]
    queued: tuple[float, float]
    rate: float
    refused: int
    load: float


def run_crowd(model: str, connections: int, requests: int, repeats: int, control: bool = True) -> None:
    """``chat`` (``critical``) alone and under ``connections`` streams of ``bulk``, interleaved ``repeats`` times on
    one stack per row (alone, flood, alone, flood...: a host whose load moves moves both halves of a pair): ``bulk``
    ``sheddable`` with shedding on (refused floods come straight back), ``sheddable`` and ``standard`` with shedding
    off, and the control where both are ``standard``."""
    import multiprocessing  # noqa: PLC0415

    context = multiprocessing.get_context("spawn")

    async def phase(http: aiohttp.ClientSession) -> tuple[list[float], float]:
        before = await fleet_gauges(http)
        ttfts = await chat_ttfts(http, requests)
        after = await fleet_gauges(http)
        count = after["queue_count"] - before["queue_count"]
        return ttfts, (after["queue_sum"] - before["queue_sum"]) / count if count else float("nan")

    async def pairs(url: str, _pid: int) -> list[Pair]:
        done: list[Pair] = []
        async with aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=600)) as http:
            for _ in range(repeats):
                load = os.getloadavg()[0]
                await until(http, lambda g: not g["running"] and not g["waiting"], 120, "idle")
                alone, alone_queued = await phase(http)
                stop, counted, refused = context.Event(), context.Value("q", 0), context.Value("q", 0)
                crowd = context.Process(target=crowd_process,
                                        args=(url, "key-bulk", connections, 256, stop, counted, refused))
                crowd.start()
                await until(http, lambda g: g["running"] >= SLOTS and counted.value > 0, 120, "full")
                before, started = counted.value, time.perf_counter()
                flood, flood_queued = await phase(http)
                rate = (counted.value - before) / (time.perf_counter() - started)
                stop.set()
                crowd.join(60)
                done.append(Pair(alone, flood, (alone_queued, flood_queued), rate, refused.value,
                                 (load + os.getloadavg()[0]) / 2))
        return done

    docs = {name: key_file(document({"bulk": {"class": bulk}, "chat": {"class": chat}}))
            for name, bulk, chat in (("sheddable", "sheddable", "critical"), ("standard", "standard", "critical"),
                                     ("control", "standard", "standard"))}
    rows = (("bulk sheddable, shedding on", docs["sheddable"], ""),
            ("bulk sheddable, shedding off", docs["sheddable"], NO_SHEDDING),
            ("bulk standard", docs["standard"], NO_SHEDDING),
            ("control: both standard", docs["control"], NO_SHEDDING))[:None if control else 3]
    print(f"\ncrowd: bulk keeps {connections} connections of 256-token streams ({SLOTS} slots), chat (critical; "
          f"standard in the control): {requests} requests of 8 tokens, one after another, alone then under the "
          f"flood, {repeats} pairs on one stack per row")
    print("| row | pair | load | alone p50 / p99 (s) | flood p50 / p99 (s) | p50 ratio | p99 ratio | chat queued, "
          "alone / flood (ms) | bulk tokens/s | bulk refused |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, doc, shedding in rows:
        found = with_stack(model, f"--max-requests {SLOTS} {shedding} --api-key-file {doc}", pairs)
        for index, pair in enumerate(found, 1):
            print(f"| {name} | {index} | {pair.load:.1f} | {percentile(pair.alone, 50):.3f} / "
                  f"{percentile(pair.alone, 99):.3f} | {percentile(pair.flood, 50):.3f} / "
                  f"{percentile(pair.flood, 99):.3f} | {ratio(pair.flood, pair.alone, 50):.2f} | "
                  f"{ratio(pair.flood, pair.alone, 99):.2f} | {pair.queued[0] * 1000:.1f} / "
                  f"{pair.queued[1] * 1000:.1f} | {pair.rate:.0f} | {pair.refused} |")
        alone = [t for pair in found for t in pair.alone]
        flood = [t for pair in found for t in pair.flood]
        print(f"| {name} | all | | {percentile(alone, 50):.3f} / {percentile(alone, 99):.3f} | "
              f"{percentile(flood, 50):.3f} / {percentile(flood, 99):.3f} | {ratio(flood, alone, 50):.2f} | "
              f"{ratio(flood, alone, 99):.2f} | | | |")


def ratio(flood: list[float], alone: list[float], q: float) -> float:
    return percentile(flood, q) / percentile(alone, q)


def run_weights(model: str, seconds: float, warmup: float = 10.0) -> None:
    doc = key_file(document({"w1": {"class": "standard", "weight": 1}, "w3": {"class": "standard", "weight": 3}}))

    async def body(url: str, _pid: int) -> dict[str, int]:
        stop, counted = asyncio.Event(), {}
        loops = [asyncio.ensure_future(closed_loop(url, key, 2 * SLOTS, 64, stop, counted))
                 for key in ("key-w1", "key-w3")]
        await asyncio.sleep(warmup)  # until the requests sent first, in arrival order, have finished
        before = dict(counted)
        await asyncio.sleep(seconds)
        window = {key: counted.get(key, 0) - before.get(key, 0) for key in ("key-w1", "key-w3")}
        stop.set()
        await asyncio.gather(*loops)
        return window

    window = with_stack(model, f"--max-requests {SLOTS} {NO_SHEDDING} --api-key-file {doc}", body)
    print(f"\nweights: two tenants of one class, {2 * SLOTS} streams of 64 tokens each in flight, {seconds:g} s")
    print(f"| tenant | weight | tokens | share |\n|---|---|---|---|")
    total = sum(window.values())
    for key, weight in (("key-w1", 1), ("key-w3", 3)):
        print(f"| {key[4:]} | {weight} | {window[key]} | {window[key] / total:.3f} |")
    print(f"ratio w3 / w1: {window['key-w3'] / max(window['key-w1'], 1):.2f} (weights: 3.00)")


def run_overhead(model: str, baseline: str | None, repeats: int, requests: int) -> None:
    """CPU per request at 64 streams, no tenants: this tree and the baseline's, alternated."""
    trees = {"this tree": None} | ({"baseline": baseline} if baseline else {})
    cpu: dict[str, list[dict[str, float]]] = {name: [] for name in trees}

    async def load(url: str) -> None:
        work = prompts(requests, 128, 3)
        async with aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=600),
                                         connector=aiohttp.TCPConnector(limit=70)) as http:
            queue = list(work)

            async def worker() -> None:
                while queue:
                    await stream(http, "none", queue.pop(), 64)

            await asyncio.gather(*(worker() for _ in range(64)))

    for _ in range(repeats):
        for name, tree in trees.items():
            env = None if tree is None else {"PYTHONPATH": os.pathsep.join(
                [str(Path(tree) / "runtime"), str(Path(tree) / "kernels"), os.environ.get("PYTHONPATH", "")])}

            async def measured(url: str, pid: int) -> dict[str, float]:
                start = stack_cpu_seconds(pid) or {}
                await load(url)
                end = stack_cpu_seconds(pid) or {}
                return {part: (end[part] - start.get(part, 0.0)) / requests for part in end}

            cpu[name].append(with_stack(model, "--max-requests 64", measured, env))
    print(f"\noverhead: no tenants, 64 streams of 64 tokens, {requests} requests; CPU ms per request (median of "
          f"{repeats})")
    print("| tree | server | coordinator | engine |\n|---|---|---|---|")
    for name, runs in cpu.items():
        cells = [statistics.median(run.get(part, 0.0) for run in runs) * 1000 for part in
                 ("server", "coordinator", "engines")]
        print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: a new tiny model)")
    parser.add_argument("--only", choices=("flood", "crowd", "weights", "overhead"), action="append")
    parser.add_argument("--requests", type=int, default=40, help="chat's requests per flood level")
    parser.add_argument("--connections", type=int, default=200, help="the crowd's flood connections")
    parser.add_argument("--pairs", type=int, default=3, help="the crowd's alone/flood pairs per row")
    parser.add_argument("--no-control", action="store_true",
                        help="the crowd without its control (chat waits behind the flood there: minutes)")
    parser.add_argument("--seconds", type=float, default=20.0, help="the weights' window")
    parser.add_argument("--baseline", help="a checkout of the tree before tenants, for the overhead's control")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--overhead-requests", type=int, default=256)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from megatron_serve.model.tiny import make_tiny_model  # noqa: PLC0415

        model = str(make_tiny_model(scratch_dir("bench-tiny-") / "tiny-llama"))
    MODEL_NAME[0] = Path(model).name
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    only = set(args.only or ("flood", "weights", "overhead"))
    if "flood" in only:
        run_flood(model, args.requests)
    if "crowd" in only:
        run_crowd(model, args.connections, args.requests, args.pairs, not args.no_control)
    if "weights" in only:
        run_weights(model, args.seconds)
    if "overhead" in only:
        run_overhead(model, args.baseline, args.repeats, args.overhead_requests)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
