"""The host's ceiling: the whole served stack (``megatron-serve run``: HTTP server(s), coordinator, engine processes
with their scheduler, sampler and output path) serving a model whose forward costs nothing, so that its tokens/s is
what the host can carry and its CPU per token is the host's alone, process by process and stage by stage.

The forward is ``benchmarks/stand_in/stand_in_forward.py``'s: fixed logits of the model's vocabulary (128,256 words
by default, Llama 3's), a row per sampled row, returned at once; everything around it runs as served. The load is
``benchmarks/serving.py``'s: ``C`` streamed ``/v1/completions`` in flight (closed loop, staggered output lengths),
through its aiohttp client, for each ``--concurrency`` level, each mode and each ``--api-server-count``. Prompts are
text (the server tokenizes them). Modes: ``greedy`` (temperature 0, n 1) and ``sampled`` (temperature 1, ``--n``
choices, ``--logprobs`` log probabilities streamed with every token).

Printed per level: output tokens/s (wall clock, on this machine with whatever else runs on it), then CPU
milliseconds per 1,000 output tokens by stage (rows) and process (columns: the HTTP server processes together, the
coordinator, the engines), from ``benchmarks/stage_profile.py`` (``py-spy`` sampling each process, its CPU from
``/proc`` split by samples); and the ceiling the busiest process sets: the tokens/s at which it would fill one core.
Without ``py-spy`` installed the stages read ``other`` and only the process totals are measured.

    python benchmarks/host_ceiling.py                                      # c 64/256/1024, both modes, 1 and 2 servers
    python benchmarks/host_ceiling.py --concurrency 64 --modes sampled --api-servers 1 --requests 256
    python benchmarks/host_ceiling.py --json                               # also one JSON line per level
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import serving
import serving_stack
from scratch import scratch_dir
from stage_profile import NAMES, Sampled, StageProfile

STAND_IN = Path(__file__).resolve().parent / "stand_in"
MODES = ("greedy", "sampled")
ROLES = ("server", "coordinator", "engines")


@dataclass
class Level:
    """One measured level: what ran, its rate and its processes sampled."""

    api_servers: int
    mode: str
    concurrency: int
    tokens: int
    elapsed: float
    sampled: list[Sampled]

    def per_1k(self) -> dict[str, dict[str, float]]:
        """CPU ms per 1,000 output tokens: ``{stage: {role: ms}}``."""
        table: dict[str, dict[str, float]] = {name: dict.fromkeys(ROLES, 0.0) for name in NAMES}
        for item in self.sampled:
            for stage, seconds in item.stages().items():
                table[stage][item.role] += seconds * 1e6 / self.tokens
        return table

    def ceiling(self) -> tuple[float, str]:
        """Tokens/s at which the busiest single process would use a whole core, and which process that is."""
        busiest = max(self.sampled, key=lambda item: item.cpu)
        seconds = busiest.cpu
        return (self.tokens / seconds if seconds else float("inf")), f"{busiest.role} {busiest.pid}"

    def waited_per_1k(self) -> dict[str, float]:
        """Milliseconds per 1,000 output tokens each role's threads were ready to run and waited for a core: no
        CPU, but sampled where they resumed (``stage_profile``'s docstring), so a stage split to read with care."""
        waited = dict.fromkeys(ROLES, 0.0)
        for item in self.sampled:
            waited[item.role] += item.waited * 1e6 / self.tokens
        return waited

    def summary(self) -> dict:
        table = self.per_1k()
        rate, busiest = self.ceiling()
        return {"api_servers": self.api_servers, "mode": self.mode, "concurrency": self.concurrency,
                "tokens": self.tokens, "tokens_per_s": self.tokens / self.elapsed,
                "ceiling_tokens_per_s": rate, "busiest": busiest,
                "ms_per_1k": {role: sum(table[s][role] for s in NAMES) for role in ROLES},
                "waited_ms_per_1k": self.waited_per_1k(),
                "stages": {stage: row for stage, row in table.items() if any(row.values())}}


def print_level(level: Level, sampling: bool) -> None:
    summary = level.summary()
    table = level.per_1k()
    print(f"\n--api-server-count {level.api_servers}, {level.mode}, concurrency {level.concurrency}: "
          f"{level.tokens} tokens in {level.elapsed:.1f}s, {summary['tokens_per_s']:.0f} tok/s; the busiest process "
          f"({summary['busiest']}) fills a core at {summary['ceiling_tokens_per_s']:.0f} tok/s")
    header = ["stage (CPU ms / 1k tokens)", *ROLES, "all"]
    rows = [[stage, *(f"{table[stage][r]:.2f}" for r in ROLES), f"{sum(table[stage].values()):.2f}"]
            for stage in NAMES if any(table[stage].values())]
    totals = summary["ms_per_1k"]
    rows.append(["process total", *(f"{totals[r]:.2f}" for r in ROLES), f"{sum(totals.values()):.2f}"])
    waited = summary["waited_ms_per_1k"]
    rows.append(["waiting for a core (not CPU)", *(f"{waited[r]:.2f}" for r in ROLES), f"{sum(waited.values()):.2f}"])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join([row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:], widths[1:]))]) + " |")
    if not sampling:
        print("(py-spy is not installed: every process's CPU reads 'other')")


def text_prompts(count: int, words: int, seed: int) -> list[str]:
    """``count`` prompts of ``words`` words each, drawn from the tiny model's corpus (the server tokenizes them)."""
    from megatron_serve.model.tiny import CORPUS  # noqa: PLC0415

    vocabulary = CORPUS.split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(vocabulary) for _ in range(words)) for _ in range(count)]


def sampling_for(mode: str, n: int, logprobs: int) -> serving.Sampling:
    return serving.Sampling() if mode == "greedy" else serving.Sampling(temperature=1.0, n=n, logprobs=logprobs)


def stack_members(run_pid: int) -> list[tuple[int, str]]:
    """The stack's processes and their roles: ``run`` itself serves HTTP."""
    return [(run_pid, "server"), *serving_stack.stack_processes(run_pid)]


def run_stack(args: argparse.Namespace, model_dir: str, api_servers: int, out_dir: Path) -> list[Level]:
    pinning = serving_stack.Pinning.plan(args.engines, args.pin)
    run_args = f"{args.run_args} --api-server-count {api_servers}"
    proc, url, output = serving_stack.start_stack(model_dir, args.engines, run_args)
    levels = []
    try:
        serving_stack.pin_stack(proc.pid, pinning)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        profile = StageProfile(stack_members(proc.pid), out_dir, args.rate)
        for mode in args.modes:
            serving.SAMPLING = sampling_for(mode, args.n, args.logprobs)
            warm = serving.Workload(text_prompts(4, args.prompt_words, args.seed + 99), [4] * 4)
            asyncio.run(serving.serve_level(url, model, {}, warm, 4))  # every path run once before it is timed
            for c in args.concurrency:
                count = args.requests or 2 * c
                work = serving.workload(count, 1, args.output_tokens, 2, "staggered", args.seed + c)
                work.prompts = text_prompts(count, args.prompt_words, args.seed + c)
                profile.start(f"a{api_servers}-{mode}-c{c}")
                samples, elapsed = asyncio.run(serving.serve_level(url, model, {}, work, c))
                sampled = profile.stop()
                tokens = sum(s.tokens for s in samples)
                if tokens != work.tokens:
                    raise SystemExit(f"{tokens} tokens streamed, {work.tokens} asked for")
                level = Level(api_servers, mode, c, tokens, elapsed, sampled)
                levels.append(level)
                print_level(level, profile.sampling)
                if args.json:
                    print(json.dumps(level.summary()))
                sys.stdout.flush()
    finally:
        serving_stack.stop_stack(proc)
        if proc.returncode not in (0, None, -15, 130):
            print(output.read_text()[-3000:], file=sys.stderr)
    return levels


def levels_list(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{name} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"{name} takes integers >= 1, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="64,256,1024", help="comma-separated levels")
    parser.add_argument("--api-servers", default="1,2", help="comma-separated --api-server-count values")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--requests", type=int, default=0, help="requests per level (default: 2 x concurrency)")
    parser.add_argument("--output-tokens", type=int, default=64, help="per choice, staggered over half to 1.5 times")
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--n", type=int, default=4, help="choices per request, sampled mode")
    parser.add_argument("--logprobs", type=int, default=1, help="alternatives streamed with each token, sampled mode")
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--run-args", default="", help="extra `megatron-serve run` options")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second per process")
    parser.add_argument("--threads", type=int, default=1, help="torch/OpenMP/BLAS threads of every process")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="as benchmarks/serving.py's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="also print each level's figures as a JSON line")
    parser.add_argument("--keep-samples", metavar="DIR", help="write py-spy's collapsed stacks here (one file per level "
                                                             "and process) and keep them")
    args = parser.parse_args()
    args.concurrency = levels_list(args.concurrency, "--concurrency")
    api_servers = levels_list(args.api_servers, "--api-servers")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        parser.error(f"--modes takes {', '.join(MODES)}, got {unknown or args.modes}")
    for name, value, low in (("--n", args.n, 1), ("--logprobs", args.logprobs, 0), ("--threads", args.threads, 1),
                             ("--rate", args.rate, 1), ("--output-tokens", args.output_tokens, 2),
                             ("--prompt-words", args.prompt_words, 1), ("--vocab-size", args.vocab_size, 600)):
        if value < low:
            parser.error(f"{name} must be >= {low}, got {value}")
    for name in serving.THREAD_VARIABLES:
        os.environ[name] = str(args.threads)
    # the stand-in forward in every process of the stack (sitecustomize, from the path)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(STAND_IN), os.environ.get("PYTHONPATH")]))
    os.environ["MEGATRON_BENCH_STAND_IN_FORWARD"] = "1"

    from megatron_serve.model.tiny import make_tiny_model  # noqa: PLC0415

    work_dir = scratch_dir("bench-host-ceiling-")
    model_dir = str(make_tiny_model(work_dir / "model", vocab_size=args.vocab_size))
    print(f"model: the tiny Llama's tokenizer padded to {args.vocab_size} words, forward: fixed logits at once; "
          f"output {args.output_tokens // 2}-{args.output_tokens * 3 // 2} tokens per choice, prompts of "
          f"{args.prompt_words} words; sampled: temperature 1, n {args.n}, logprobs {args.logprobs}; "
          f"{args.threads} thread(s) per process; {serving_stack.Pinning.plan(args.engines, args.pin).describe()}",
          flush=True)
    started = time.monotonic()
    samples_dir = work_dir
    if args.keep_samples:
        samples_dir = Path(args.keep_samples)
        samples_dir.mkdir(parents=True, exist_ok=True)
    for count in api_servers:
        run_stack(args, model_dir, count, samples_dir)
    print(f"\n{time.monotonic() - started:.0f}s in all", file=sys.stderr)


if __name__ == "__main__":
    main()
