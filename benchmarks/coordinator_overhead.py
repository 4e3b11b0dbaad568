"""What the coordinator costs: requests/s through it, and latency added over direct mode.

Every request generates ONE token, so the model's work is as small as it gets and what remains is
the path client -> coordinator (tokenize, route) -> engine process -> coordinator -> client.
Direct mode runs the same engine in this process (``MegatronAsyncLLM`` without a coordinator).

    python benchmarks/coordinator_overhead.py                       # tiny model, 1 and 2 engines
    python benchmarks/coordinator_overhead.py --model DIR --requests 5000 --concurrency 1,32,256

Prints one table. Latency is per request, from submission to the final result; "added" is the
coordinator mode's percentile minus direct mode's at the same concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Awaitable, Callable

from megatron_serve import InferenceConfig, MegatronAsyncLLM, SamplingParams
from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.fleet.local_fleet import LocalFleet
from scratch import scratch_dir

ONE_TOKEN = SamplingParams(temperature=0.0, num_tokens_to_generate=1, ignore_eos=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[index]


async def closed_loop(submit: Callable[[str], Awaitable], requests: int, concurrency: int) -> tuple[list[float], float]:
    """``concurrency`` workers, each submitting its next request when the previous one finished."""
    latencies: list[float] = []
    counter = iter(range(requests))

    async def worker() -> None:
        for i in counter:
            started = time.perf_counter()
            result = await submit(f"bench request {i}: the quick brown fox")
            latencies.append(time.perf_counter() - started)
            if result.status.value != "COMPLETED":
                raise RuntimeError(f"request failed: {result.error}")

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - started


async def measure(submit, requests: int, concurrency: int, warmup: int) -> dict:
    await closed_loop(submit, warmup, min(concurrency, warmup))
    latencies, elapsed = await closed_loop(submit, requests, concurrency)
    return {"rps": requests / elapsed, "p50": percentile(latencies, 50) * 1e3, "p99": percentile(latencies, 99) * 1e3,
            "mean": statistics.fmean(latencies) * 1e3}


async def main(args: argparse.Namespace) -> None:
    model = args.model
    if model is None:
        from megatron_serve.model.tiny import make_tiny_model

        model = str(make_tiny_model(scratch_dir("bench-tiny-"), seed=0))
    config = InferenceConfig(num_kv_blocks=args.num_kv_blocks, max_requests=args.max_requests)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    engine_counts = [int(e) for e in args.engines.split(",")]
    rows: list[tuple] = []

    print(f"model {model}; {args.requests} requests of 1 token per measurement", file=sys.stderr)
    direct: dict[int, dict] = {}
    async with MegatronAsyncLLM(model, config) as llm:
        for c in concurrencies:
            direct[c] = await measure(lambda p: llm.generate(p, ONE_TOKEN), args.requests, c, args.warmup)
            rows.append(("direct", "-", c, direct[c], None))
            print(f"  direct c={c}: {direct[c]['rps']:.0f} req/s", file=sys.stderr)

    for engines in engine_counts:
        fleet = LocalFleet(model, engines, config)
        try:
            address = await asyncio.to_thread(fleet.start)
            client = InferenceClient(address, token=fleet.token)
            await client.start(timeout=120)
            await client.wait_for_engines(engines, timeout=600)
            for c in concurrencies:
                result = await measure(lambda p: client.add_request(p, ONE_TOKEN), args.requests, c, args.warmup)
                rows.append(("coordinator", engines, c, result, direct[c]))
                print(f"  coordinator engines={engines} c={c}: {result['rps']:.0f} req/s", file=sys.stderr)
            await client.stop(timeout=120)
            client.close()
        finally:
            await asyncio.to_thread(fleet.stop, 60.0, True)
            fleet.kill()

    header = f"{'mode':<12} {'engines':>7} {'conc':>5} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8}"
    print(header)
    print("-" * len(header))
    for mode, engines, c, r, base in rows:
        added = ("", "") if base is None else (f"{r['p50'] - base['p50']:+.2f}", f"{r['p99'] - base['p99']:+.2f}")
        print(f"{mode:<12} {engines!s:>7} {c:>5} {r['rps']:>8.0f} {r['p50']:>8.2f} {r['p99']:>8.2f} "
              f"{added[0]:>8} {added[1]:>8}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: a fresh tiny random model)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--concurrency", default="1,64", help="comma-separated closed-loop concurrencies")
    parser.add_argument("--engines", default="1,2", help="comma-separated engine counts for coordinator mode")
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    parser.add_argument("--max-requests", type=int, default=64)
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
