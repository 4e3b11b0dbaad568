"""Serving benchmark, ``vllm bench serve``'s equivalent: the OpenAI HTTP API under a concurrency sweep, against
the same workload run offline in the same run.

Each level keeps ``C`` streamed completions in flight (closed loop: a client sends its next request
when the previous one ends) until its requests have finished. Prompts are random token ids drawn
from the served model's vocabulary (its ``config.json``, or with ``--url`` and no ``--model``, the
largest id its ``/detokenize`` accepts); outputs are greedy (or sampled: ``--temperature``, ``--top-p``,
``--top-k``, ``--n``; ``--rl``: temperature 1, n 8, 1,024 output tokens; ``--logprobs``: log probabilities streamed
with every token, the offline engine computing them too) with EOS ignored, of the same length
(``uniform``) or spread over half to one and a half times ``--output-tokens`` (``staggered``: requests
finish and start nearly every step, as online). The same prompts and lengths then run offline: an
engine in this process, the requests added at once with ``C`` running at most, stepped until done
(what ``MegatronLLM.generate`` does, without its event loop). Per level: output tokens/s served and
offline and their ratio, TTFT and TPOT percentiles, end-to-end latency, and (for a stack it started,
on Linux; with ``--url``, of the stack whose process listens on the URL's port here) the CPU time each of
its processes spent per 1,000 output tokens, beside the offline
engine's: on a machine shared with other work, throughput moves with everyone's load, CPU time per
token much less.

What it pins, and prints before the table (``--threads``, ``--no-pin``): every process it runs or starts
uses ``--threads`` threads for torch and BLAS (``OMP_NUM_THREADS`` and its kin, default 1: without it
the offline baseline swung from 141 to 1,978 tok/s between repeats on a shared 2-core machine, ratios
2.4 to 20.5), and where the machine has a core per engine and one left (``sched_setaffinity``, Linux),
each served engine runs on a core of its own, the offline engine on engine 0's core, and the HTTP
server(s) and coordinator on the remaining cores. ``--pin-coordinator`` gives the coordinator the last core alone
and runs everything else, this client included, on the others (on 2 cores: all of it on core 0), as a deployment
would: sharing a core with the server and the client, its CPU per token read 13-47 run to run.
``--run-args "--api-server-count 2"`` runs two HTTP processes; their CPU time counts as the server's.

Server-sent events are parsed as the specification says (lines end at CR, LF or CRLF only; an empty
line ends an event; ``data:`` lines join with newlines), so text holding U+2028 or other Unicode line
breaks does not cut an event.

    python benchmarks/serving.py                                   # starts `megatron-serve run` on a tiny model
    python benchmarks/serving.py --model DIR --run-args "--dtype bfloat16 --num-kv-blocks 4096" --concurrency 64
    python benchmarks/serving.py --url http://127.0.0.1:8000 --model DIR    # a running server (offline from DIR)
    python benchmarks/serving.py --rl --concurrency 8                # RL rollouts: temperature 1, n 8, long outputs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
from engine_run import run_to_end
from scratch import scratch_dir
from serving_stack import (Pinning, listening_pid, pin_process, pin_stack, stack_cpu_seconds, start_stack,
                           stop_stack)

LENGTHS = ("uniform", "staggered")
#: Thread-count variables torch, OpenMP and the BLAS libraries read at start.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass
class Sample:
    ttft: float
    tpot: float | None
    latency: float
    tokens: int


@dataclass
class Cost:
    """CPU milliseconds per 1,000 output tokens, by process."""

    server: float
    coordinator: float
    engines: float


@dataclass
class Sampling:
    """How every request samples: greedy at temperature 0; ``n`` choices per request; ``logprobs``: the completion
    API's (each token's log probability and its ``logprobs`` best alternatives streamed), None for none."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    logprobs: int | None = None

    def body(self) -> dict:
        """The completion request's sampling fields (vLLM's ``top_k`` among them)."""
        fields = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "n": self.n}
        return fields if self.logprobs is None else {**fields, "logprobs": self.logprobs}

    def describe(self) -> str:
        told = "" if self.logprobs is None else f", logprobs {self.logprobs}"
        if not self.temperature:
            return "greedy" + (f", n {self.n}" if self.n > 1 else "") + told
        return f"sampled (temperature {self.temperature}, top-p {self.top_p}, top-k {self.top_k}, n {self.n}{told})"


SAMPLING = Sampling()  # set once from the command line


@dataclass
class Workload:
    prompts: list[list[int]]
    lengths: list[int]  # output tokens of each choice of each request

    @property
    def tokens(self) -> int:
        return sum(self.lengths) * SAMPLING.n


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def workload(count: int, prompt_tokens: int, output_tokens: int, vocab_size: int, lengths: str, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(min(10, vocab_size - 1), vocab_size) for _ in range(prompt_tokens)] for _ in range(count)]
    if lengths == "uniform":
        outputs = [output_tokens] * count
    else:  # spread evenly over [n/2, 3n/2] in a shuffled order: the mean is n, finishes fall on every step
        spread = [max(1, output_tokens // 2 + (output_tokens * i) // max(count - 1, 1)) for i in range(count)]
        outputs = rng.sample(spread, count)
    return Workload(prompts, outputs)


# ----------------------------------------------------------------------------- server-sent events


class EventStream:
    """Server-sent events from a byte stream, as the HTML specification parses them: only CR, LF and CRLF
    end a line (so a U+2028 inside JSON does not), ``data:`` lines of one event join with LF, an empty
    line dispatches the event, comments (``:``) and other fields are ignored."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []
        self._cr = False  # the last chunk ended in CR: a LF starting the next one belongs to it

    def feed(self, chunk: bytes) -> list[str]:
        """The data of every event that ``chunk`` completes."""
        if self._cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._cr = False
        self._buffer += chunk
        events: list[str] = []
        while True:
            cut = min((i for i in (self._buffer.find(b"\r"), self._buffer.find(b"\n")) if i >= 0), default=-1)
            if cut < 0:
                return events
            line, rest = self._buffer[:cut], self._buffer[cut + 1:]
            if self._buffer[cut:cut + 1] == b"\r":
                if rest.startswith(b"\n"):
                    rest = rest[1:]
                elif not rest:
                    self._cr = True
            self._buffer = rest
            self._line(line.decode("utf-8"), events)

    def _line(self, line: str, events: list[str]) -> None:
        if not line:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)


# ----------------------------------------------------------------------------- serving


async def completion_messages(http: aiohttp.ClientSession, body: dict, headers: dict[str, str] | None = None
                              ) -> AsyncIterator[dict]:
    """The JSON messages of one streamed ``/v1/completions`` answer, in order; an HTTP error or an error message
    raises ``RuntimeError`` with its text."""
    events = EventStream()
    async with http.post("/v1/completions", json=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.read()).decode()[:300]}")
        async for chunk in response.content.iter_any():
            for data in events.feed(chunk):
                if data == "[DONE]":
                    continue
                message = json.loads(data)
                if "error" in message:
                    raise RuntimeError(message["error"]["message"])
                yield message


async def one_request(http: aiohttp.ClientSession, model: str, prompt: list[int], output_tokens: int) -> Sample:
    body = {"model": model, "prompt": prompt, "max_tokens": output_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, **SAMPLING.body()}
    started = time.perf_counter()
    first = last = None
    tokens = 0
    async for message in completion_messages(http, body):
        if message.get("usage"):
            tokens = message["usage"]["completion_tokens"]
        if any(choice.get("text") for choice in message["choices"]):
            last = time.perf_counter()
            first = first or last
    end = time.perf_counter()
    if first is None or tokens == 0:
        raise RuntimeError("no tokens streamed")
    per_choice = tokens // SAMPLING.n  # the choices stream side by side
    tpot = (last - first) / (per_choice - 1) if per_choice > 1 else None
    return Sample(first - started, tpot, end - started, tokens)


async def serve_level(url: str, model: str, headers: dict[str, str], work: Workload,
                      concurrency: int) -> tuple[list[Sample], float]:
    queue: asyncio.Queue[tuple[list[int], int]] = asyncio.Queue()
    for item in zip(work.prompts, work.lengths):
        queue.put_nowait(item)
    samples: list[Sample] = []
    # aiohttp, as `vllm bench serve`: its C parser costs the client about a fifth of what httpx's pure-Python one did
    # (99 ms of CPU per 1,000 streamed tokens at c64 on the 2-core machine, where the client shares the cores
    # with the stack it measures). Idle connections expire here (2 s) before any server keep-alive timeout
    # closes them: a request sent on a connection the server was closing fails or waits (with httpx's 5 s
    # against the server's former 5 s, levels of 2,048 requests showed a TTFT p99 of 4-5.5 s, 0.34 s without).
    # aiohttp sets TCP_NODELAY (a request's headers and body are separate writes: with Nagle's algorithm the
    # body could wait for a delayed ACK, ~40 ms, measured as server latency).
    connector = aiohttp.TCPConnector(limit=concurrency + 4, keepalive_timeout=2.0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(base_url=url, headers=headers, timeout=timeout, connector=connector) as http:
        async def worker() -> None:
            while not queue.empty():
                prompt, length = queue.get_nowait()
                samples.append(await one_request(http, model, prompt, length))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return samples, elapsed


# ----------------------------------------------------------------------------- offline


def engine_config(run_args: str, max_requests: int):
    """The served engines' ``InferenceConfig`` (from the same ``--run-args``), running ``max_requests`` at most."""
    from megatron_serve.commands.engine_options import add_engine_options, inference_config_from_args  # noqa: PLC0415

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_options(parser)
    args, _ = parser.parse_known_args(shlex.split(run_args))
    args.max_requests = max_requests
    return inference_config_from_args(args)


def offline_tokens_per_s(model_dir: str, run_args: str, work: Workload, concurrency: int,
                         warmup: Workload) -> tuple[float, float]:
    """Output tokens/s of an engine in this process given the whole workload at once, ``concurrency`` running,
    and its CPU milliseconds per 1,000 tokens."""
    import gc  # noqa: PLC0415

    from megatron_serve import DynamicInferenceRequest, SamplingParams  # noqa: PLC0415
    from megatron_serve.engine import DynamicInferenceEngine  # noqa: PLC0415

    # token ids in and out, as the served engine processes: their vocabulary, not a whole tokenizer
    engine = DynamicInferenceEngine.from_model_dir(model_dir, engine_config(run_args, concurrency),
                                                   vocabulary_only=True)
    try:
        elapsed = cpu = 0.0
        for timed, part in ((False, warmup), (True, work)):
            requests = [DynamicInferenceRequest(f"{timed}-{i}-{choice}", None, prompt, params)
                        for i, (prompt, length) in enumerate(zip(part.prompts, part.lengths))
                        for choice, params in enumerate(SamplingParams(
                            temperature=SAMPLING.temperature, top_p=SAMPLING.top_p, top_k=SAMPLING.top_k,
                            n=SAMPLING.n, num_tokens_to_generate=length, ignore_eos=True,
                            logprobs=SAMPLING.logprobs).choices())]
            elapsed, cpu = run_to_end(engine, requests)
        produced = sum(len(r.generated_tokens) for r in requests)
        assert produced == work.tokens, f"offline produced {produced} tokens, expected {work.tokens}"
        return produced / elapsed, cpu * 1e6 / produced
    finally:
        engine.shutdown()
        del engine
        gc.collect()


# ----------------------------------------------------------------------------- the stack, the model


def served_vocab_size(url: str, model: str, headers: dict[str, str]) -> int:
    """One past the largest token id the server's ``/detokenize`` accepts (it refuses ids outside the vocabulary)."""
    def accepted(token: int) -> bool:
        answer = http.post(f"{url}/detokenize", json={"model": model, "tokens": [token]})
        if answer.status_code not in (200, 400):
            raise SystemExit(f"/detokenize answered {answer.status_code}: pass --vocab-size or --model")
        return answer.status_code == 200

    with httpx.Client(headers=headers, timeout=30) as http:  # one client: each new one loads the CA bundle again
        low, high = 0, 1024
        while accepted(high):
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if accepted(middle) else (low, middle)
    return high


# ----------------------------------------------------------------------------- report


def row(lengths: str, concurrency: int, samples: list[Sample], elapsed: float, offline: tuple[float, float] | None,
        cost: Cost | None, client_cpu: float) -> list[str]:
    ttft = [s.ttft * 1000 for s in samples]
    tpot = [s.tpot * 1000 for s in samples if s.tpot is not None]
    served = sum(s.tokens for s in samples) / elapsed
    rate, offline_cpu = offline or (None, None)
    cpu = "-" if cost is None else f"{cost.server:.1f} / {cost.coordinator:.1f} / {cost.engines:.1f}"
    return [lengths, str(concurrency), str(len(samples)), f"{len(samples) / elapsed:.2f}", f"{served:.1f}",
            f"{rate:.1f}" if rate else "-", f"{served / rate:.2f}" if rate else "-", f"{percentile(ttft, 50):.1f}",
            f"{percentile(ttft, 99):.1f}", f"{percentile(tpot, 50):.2f}", f"{percentile(tpot, 99):.2f}",
            f"{percentile([s.latency for s in samples], 50):.2f}", cpu, f"{offline_cpu:.0f}" if offline_cpu else "-",
            f"{client_cpu:.0f}"]


def print_table(rows: list[list[str]]) -> None:
    header = ["lengths", "concurrency", "requests", "req/s", "served tok/s", "offline tok/s", "served/offline",
              "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "e2e p50 s",
              "CPU ms/1k tok: server / coord. / engines", "offline CPU ms/1k tok", "client CPU ms/1k tok"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an already running server (default: start `megatron-serve run`)")
    parser.add_argument("--model", help="model directory or GGUF file: of the started stack, and of the offline runs (default: a "
                                        "new tiny model; with --url, no offline runs)")
    parser.add_argument("--model-name", help="served model name (default: asked from GET /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("MEGATRON_SERVE_API_KEY"))
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--run-args", default="", help="extra `megatron-serve run` options, e.g. engine sizing (the "
                                                       "offline engine is built with the same engine options)")
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels")
    parser.add_argument("--requests", type=int, default=0, help="requests per level (default: 4 x concurrency, "
                                                               "at least 16)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=None, help="default 64 (--rl: 1024)")
    parser.add_argument("--lengths", choices=[*LENGTHS, "both"], default="both",
                        help="output lengths: all --output-tokens, or staggered around it")
    parser.add_argument("--vocab-size", type=int, default=0, help="prompt ids are drawn below this (default: the "
                                                                 "served model's)")
    parser.add_argument("--no-offline", action="store_true", help="serving only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch/OpenMP/BLAS threads of every process (sets "
                                                              "OMP_NUM_THREADS and its kin; default 1)")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="do not pin engines, servers and coordinator to cores of their own")
    parser.add_argument("--pin-coordinator", action="store_true",
                        help="the coordinator alone on the last core, everything else (this client included) on the "
                             "others: its CPU per token without the server's and client's memory in its caches")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--n", type=int, default=1, help="choices per request")
    parser.add_argument("--logprobs", type=int, default=None, help="log probabilities streamed with each token, and "
                                                                   "this many alternatives (default: none)")
    parser.add_argument("--rl", action="store_true", help="RL rollouts: temperature 1, n 8, 1024 output tokens")
    args = parser.parse_args()
    if args.rl:
        args.temperature, args.n = 1.0, 8
    args.output_tokens = args.output_tokens or (1024 if args.rl else 64)
    global SAMPLING  # noqa: PLW0603 - one setting for the whole run
    SAMPLING = Sampling(args.temperature, args.top_p, args.top_k, args.n, args.logprobs)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    for name in THREAD_VARIABLES:  # before torch loads here, and inherited by the started stack
        os.environ[name] = str(args.threads)
    pinning = Pinning.plan(args.engines, args.pin and args.url is None, args.pin_coordinator)
    setting = (f"setting: {args.threads} thread(s) per process ({', '.join(THREAD_VARIABLES)}={args.threads}); "
               f"{pinning.describe()}")
    print(setting, file=sys.stderr, flush=True)
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    mixes = list(LENGTHS) if args.lengths == "both" else [args.lengths]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    model_dir = args.model
    if model_dir is not None:  # a GGUF file: the directory the stack makes of it (config, tokenizer, the file)
        from megatron_serve.model.hub import resolve_model  # noqa: PLC0415

        model_dir = str(resolve_model(model_dir))
    if model_dir is None and args.url is None:
        from megatron_serve.model.tiny import make_tiny_model  # noqa: PLC0415

        model_dir = str(make_tiny_model(scratch_dir("bench-tiny-") / "tiny-llama"))
    vocab = args.vocab_size or (int(json.loads(Path(model_dir, "config.json").read_text())["vocab_size"])
                                if model_dir else 0)

    def make_works(vocab: int) -> dict[tuple[str, int], Workload]:
        return {(mix, c): workload(args.requests or max(16, 4 * c), args.prompt_tokens, args.output_tokens, vocab,
                                   mix, args.seed + c) for mix in mixes for c in levels}

    works = make_works(vocab) if vocab else {}

    offline: dict[tuple[str, int], tuple[float, float]] = {}
    if model_dir and not args.no_offline:  # first, alone on the machine: the serving stack is not up yet
        warmup = workload(4, args.prompt_tokens, args.output_tokens, vocab, "staggered", args.seed + 99)
        if pinning.engines is not None:
            pin_process(os.getpid(), [pinning.engines[0]])
        for (mix, c), work in works.items():
            offline[(mix, c)] = offline_tokens_per_s(model_dir, args.run_args, work, c, warmup)
            print(f"offline {mix} concurrency {c}: {offline[(mix, c)][0]:.1f} tok/s", file=sys.stderr, flush=True)

    proc = None
    url = args.url
    if url is None:
        print(f"starting megatron-serve run --model {model_dir} ...", file=sys.stderr, flush=True)
        if pinning.cores is not None:
            pin_process(os.getpid(), pinning.cores)  # this client (and what it starts) on every core again
        proc, url, _output = start_stack(model_dir, args.engines, args.run_args)
        pin_stack(proc.pid, pinning)
    try:
        model = args.model_name or httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
        if not vocab:
            vocab = served_vocab_size(url, model, headers)
            works = make_works(vocab)
        asyncio.run(serve_level(url, model, headers, workload(2, args.prompt_tokens, args.output_tokens, vocab,
                                                              "uniform", args.seed + 99), 2))  # warm-up
        stack_pid = proc.pid if proc is not None else listening_pid(url)
        if stack_pid is None:
            print(f"no process of this user listens on {url} on this machine: the CPU columns stay '-'",
                  file=sys.stderr, flush=True)
        rows = []
        for (mix, c), work in works.items():
            before = stack_cpu_seconds(stack_pid) if stack_pid is not None else None
            client_started = time.process_time()
            samples, elapsed = asyncio.run(serve_level(url, model, headers, work, c))
            client_cpu = (time.process_time() - client_started) * 1e6 / work.tokens
            after = stack_cpu_seconds(stack_pid) if stack_pid is not None else None
            cost = None if before is None or after is None else Cost(
                **{k: (after[k] - before[k]) * 1e6 / work.tokens for k in before})
            rows.append(row(mix, c, samples, elapsed, offline.get((mix, c)), cost, client_cpu))
            print(f"served {mix} concurrency {c}: {len(samples)} requests in {elapsed:.1f}s", file=sys.stderr,
                  flush=True)
        print(f"\nmodel {model}: prompt {args.prompt_tokens} tokens, output {args.output_tokens} tokens (staggered: "
              f"{args.output_tokens // 2}-{args.output_tokens * 3 // 2}), {SAMPLING.describe()}, EOS ignored, streamed over {url}; "
              f"offline: an engine in this process with the same engine options\n{setting}\n")
        print_table(rows)
        for c in levels:
            if ("uniform", c) in offline and ("staggered", c) in offline:
                ratio = offline[("staggered", c)][0] / offline[("uniform", c)][0]
                print(f"concurrency {c}: staggered/uniform offline {ratio:.2f}")
    finally:
        if proc is not None:
            stop_stack(proc)


if __name__ == "__main__":
    main()
