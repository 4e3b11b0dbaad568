"""What an amplifying request costs a fleet, and what a small completion beside it waits (issue 55).

Starts ``megatron-serve run`` (a tiny model with a 2,048-token context unless ``--model``), then, each with
small two-token completions sent one after another beside it:

* the amplifying request: ``n=128``, ``prompt_logprobs=20``, ``logprobs=20``, ``max_tokens=16`` on a
  1,000-token prompt (each field within its own limit; 2.7 M log-prob entries);
* the largest such request within the default budget (``--large-n``, 48 choices: 1.02 M entries);
* four of those at once.

Prints, for each: its status, seconds and answer bytes, the small completions' latency (p50, max, how many; they
share the engine with the large request, whose prefill they wait for), the main port's ``/health`` latency (the
server's event loop alone), and the HTTP server's resident memory (peak since start, from ``/proc``), against the
small completions alone.
The tests (``tests/server/test_request_budget.py``) assert the refusal and the pace; this script measures.

    python benchmarks/request_budget.py
    PYTHONPATH=/path/to/other/checkout/runtime python benchmarks/request_budget.py   # the same against another tree
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import httpx

from scratch import scratch_dir
from serving_stack import start_stack, stop_stack

PROMPT_TOKENS = 1000


def memory_mb(pid: int) -> tuple[float, float]:
    """The process's resident memory now and its peak, in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


async def small_completions(http: httpx.AsyncClient, model: str, until: asyncio.Event | None, count: int = 0
                            ) -> list[float]:
    """Two-token completions one after another until ``until`` is set (or ``count`` of them); their latencies."""
    latencies = []
    while (until is not None and not until.is_set()) or len(latencies) < count:
        started = time.perf_counter()
        answer = await http.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 2})
        answer.raise_for_status()
        latencies.append(time.perf_counter() - started)
    return latencies


async def health_latencies(http: httpx.AsyncClient, until: asyncio.Event) -> list[float]:
    """The main port's ``/health`` every 50 ms until ``until`` is set: how long the server's event loop is held."""
    latencies = []
    while not until.is_set():
        started = time.perf_counter()
        (await http.get("/health")).raise_for_status()
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(0.05)
    return latencies


async def big_request(http: httpx.AsyncClient, body: dict) -> tuple[int, float, int, str]:
    """Status, seconds and bytes of one request's answer (read as it comes, not parsed), and its error if any."""
    started = time.perf_counter()
    received = 0
    message = ""
    async with http.stream("POST", "/v1/completions", json=body) as answer:
        async for chunk in answer.aiter_raw():
            received += len(chunk)
            if answer.status_code != 200 and len(message) < 400:
                message += chunk.decode(errors="replace")
    return answer.status_code, time.perf_counter() - started, received, message[:300]


async def phase(url: str, model: str, bodies: list[dict], pid: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http, \
            httpx.AsyncClient(base_url=url, timeout=600) as side, httpx.AsyncClient(base_url=url, timeout=600) as probe:
        done = asyncio.Event()
        beside = asyncio.create_task(small_completions(side, model, done))
        health = asyncio.create_task(health_latencies(probe, done))
        answers = await asyncio.gather(*(big_request(http, body) for body in bodies))
        done.set()
        latencies = await beside
        probes = await health
    return {"answers": answers, "latencies": latencies, "health": probes, "memory": memory_mb(pid)}


def report(label: str, result: dict) -> None:
    latencies = result["latencies"]
    now, peak = result["memory"]
    print(f"\n{label}")
    for status, seconds, received, message in result["answers"]:
        print(f"  answer: {status}, {seconds:.1f} s, {received / 1e6:.1f} MB {message}")
    print(f"  small completions beside it: {len(latencies)}, p50 {statistics.median(latencies) * 1000:.0f} ms, "
          f"max {max(latencies) * 1000:.0f} ms")
    health = result["health"]
    print(f"  the main port's /health beside it: {len(health)}, p50 {statistics.median(health) * 1000:.0f} ms, "
          f"max {max(health) * 1000:.0f} ms")
    print(f"  HTTP server memory: {now:.0f} MB now, {peak:.0f} MB peak since start")


async def run(url: str, model: str, pid: int, large_n: int) -> None:
    prompt = [5 + i % 400 for i in range(PROMPT_TOKENS)]
    amplifying = {"model": model, "prompt": prompt, "n": 128, "prompt_logprobs": 20, "logprobs": 20, "max_tokens": 16}
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await small_completions(http, model, None, 5)  # warm
        alone = await small_completions(http, model, None, 20)
    print(f"small completions alone: p50 {statistics.median(alone) * 1000:.0f} ms, max {max(alone) * 1000:.0f} ms; "
          f"HTTP server memory {memory_mb(pid)[0]:.0f} MB")
    report("the amplifying request (n=128, prompt_logprobs=20, logprobs=20, 1,000-token prompt)",
           await phase(url, model, [amplifying], pid))
    large = {**amplifying, "n": large_n}
    report(f"the same with n={large_n}", await phase(url, model, [large], pid))
    report("four of those at once", await phase(url, model, [large] * 4, pid))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: a tiny random model with a 2,048-token context)")
    parser.add_argument("--large-n", type=int, default=48, help="choices of the large request within the budget")
    parser.add_argument("--run-args", default="", help="more options of megatron-serve run")
    args = parser.parse_args()
    model_dir = args.model
    if model_dir is None:
        from megatron_serve.model.tiny import make_tiny_model  # noqa: PLC0415

        model_dir = str(make_tiny_model(scratch_dir("bench-tiny-") / "tiny-llama",
                                        max_position_embeddings=2048))
    proc, url, output = start_stack(model_dir, 1, args.run_args)
    try:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        asyncio.run(run(url, model, proc.pid, args.large_n))
    finally:
        stop_stack(proc)
    print(f"\n(stack output: {output})")


if __name__ == "__main__":
    main()
