"""Serving benchmark: a concurrency sweep over the OpenAI HTTP API with a fixed synthetic workload.

Each level keeps ``C`` streamed completions in flight (closed loop: a client sends its next request
when the previous one ends) until ``--requests`` have finished. Prompts are fixed-length random
token ids and every request generates exactly ``--output-tokens`` (greedy, EOS ignored), so levels
differ only in concurrency. Per level: p50/p99 time to first token, p50/p99 time per output token
(after the first), p50 end-to-end latency, requests/s and output tokens/s.

    python benchmarks/serving.py                                  # starts `megatron-serve run` on a tiny model
    python benchmarks/serving.py --model DIR --run-args "--dtype bfloat16 --num-kv-blocks 4096"
    python benchmarks/serving.py --url http://127.0.0.1:8000 --model-name NAME   # an existing server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class Sample:
    ttft: float
    tpot: float | None
    latency: float
    tokens: int


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def workload(count: int, prompt_tokens: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(prompt_tokens)] for _ in range(count)]


async def one_request(http: httpx.AsyncClient, model: str, prompt: list[int], output_tokens: int) -> Sample:
    body = {"model": model, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "logprobs": 0}  # logprobs: every chunk lists its tokens, so they can be counted
    started = time.perf_counter()
    first = last = None
    tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for choice in chunk["choices"]:
                count = len((choice.get("logprobs") or {}).get("tokens") or [])
                if count:
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    tokens += count
    end = time.perf_counter()
    if first is None:
        raise RuntimeError("no tokens streamed")
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return Sample(first - started, tpot, end - started, tokens)


async def run_level(url: str, model: str, headers: dict[str, str], prompts: list[list[int]], concurrency: int,
                    output_tokens: int) -> tuple[list[Sample], float]:
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    # TCP_NODELAY: a request's headers and body are separate writes; with Nagle's algorithm the body
    # could wait for a delayed ACK (~40 ms), which would be measured as server latency.
    transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, transport=transport) as http:
        async def worker() -> None:
            while True:
                try:
                    prompt = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                samples.append(await one_request(http, model, prompt, output_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return samples, elapsed


def row(concurrency: int, samples: list[Sample], elapsed: float) -> list[str]:
    ttft = [s.ttft * 1000 for s in samples]
    tpot = [s.tpot * 1000 for s in samples if s.tpot is not None]
    latency = [s.latency for s in samples]
    tokens = sum(s.tokens for s in samples)
    return [str(concurrency), str(len(samples)), f"{len(samples) / elapsed:.2f}", f"{tokens / elapsed:.1f}",
            f"{percentile(ttft, 50):.1f}", f"{percentile(ttft, 99):.1f}", f"{percentile(tpot, 50):.2f}",
            f"{percentile(tpot, 99):.2f}", f"{percentile(latency, 50):.2f}"]


def print_table(rows: list[list[str]]) -> None:
    header = ["concurrency", "requests", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
              "TPOT p99 ms", "e2e p50 s"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |"
    print(line)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")


# ----------------------------------------------------------------------------- a server to measure


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_stack(model_dir: str, engines: int, run_args: str) -> tuple[subprocess.Popen, str, Path]:
    """``megatron-serve run`` in its own session; returns it, its URL and its output file."""
    port = free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    output = log_dir / "run.out"
    with open(output, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "megatron_serve.cli", "run", "--model", model_dir,
                                 "--port", str(port), "--coordinator-port", "0", "--engines", str(engines),
                                 "--log-dir", str(log_dir), *shlex.split(run_args)],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={k: v for k, v in os.environ.items()
                                                             if k != "MEGATRON_SERVE_API_KEY"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"megatron-serve run exited ({proc.returncode}):\n{output.read_text()}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return proc, url, output
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"megatron-serve run was not ready after 600s:\n{output.read_text()}")
        time.sleep(0.2)


def stop_stack(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an already running server (default: start `megatron-serve run`)")
    parser.add_argument("--model", help="model directory for the started stack (default: a new tiny model)")
    parser.add_argument("--model-name", help="served model name (default: asked from GET /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("MEGATRON_SERVE_API_KEY"))
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--run-args", default="", help="extra `megatron-serve run` options, e.g. engine sizing")
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated levels")
    parser.add_argument("--requests", type=int, default=0, help="requests per level (default: 4 x concurrency, "
                                                               "at least 16)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=0, help="prompt ids are drawn below this (default: "
                                                                 "the model's, capped at 32000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]

    proc = None
    url = args.url
    vocab = args.vocab_size
    if url is None:
        model_dir = args.model
        if model_dir is None:
            from megatron_serve.tiny_model import make_tiny_model  # noqa: PLC0415

            model_dir = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="bench-tiny-")) / "tiny-llama"))
        if not vocab:
            vocab = int(json.loads(Path(model_dir, "config.json").read_text())["vocab_size"])
        print(f"starting megatron-serve run --model {model_dir} ...", file=sys.stderr, flush=True)
        proc, url, _output = start_stack(model_dir, args.engines, args.run_args)
    vocab = min(vocab or 32000, 32000)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = args.model_name or httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
        asyncio.run(run_level(url, model, headers, workload(2, args.prompt_tokens, vocab, args.seed + 99), 2,
                              args.output_tokens))  # warm-up
        rows = []
        for concurrency in levels:
            count = args.requests or max(16, 4 * concurrency)
            prompts = workload(count, args.prompt_tokens, vocab, args.seed + concurrency)
            samples, elapsed = asyncio.run(run_level(url, model, headers, prompts, concurrency, args.output_tokens))
            rows.append(row(concurrency, samples, elapsed))
            print(f"concurrency {concurrency}: {len(samples)} requests in {elapsed:.1f}s", file=sys.stderr,
                  flush=True)
        print(f"\nmodel {model}: prompt {args.prompt_tokens} tokens, output {args.output_tokens} tokens "
              f"(greedy, EOS ignored), streamed over {url}\n")
        print_table(rows)
    finally:
        if proc is not None:
            stop_stack(proc)


if __name__ == "__main__":
    main()
