"""In-place refit versus restarting the engine process: how long new weights take to serve.

Two random checkpoints of the same (a few hundred MB) architecture are written once; a local
fleet (coordinator + one engine process) serves the first. Then, alternating between them:

* **refit in place**: PAUSE, REFIT (verify on every engine, then load), UNPAUSE, first request;
* **restart**: SIGTERM the engine (it drains and exits), start a new engine process on the other
  checkpoint, wait until it registered, first request. This is what rolling a pod costs at best
  (no image pull, no scheduling, no container start).

Each phase is timed by the client (acknowledgement round trips); the engine's own verify/load
split comes from the REFIT acknowledgement. Prints one table (median of ``--rounds``).

    python benchmarks/refit.py                                   # ~360 MB fp32 checkpoints on CPU
    python benchmarks/refit.py --hidden-size 2048 --layers 8 --rounds 5

``--finite-check`` measures instead what the NaN/Inf check (``megatron_serve.model.finite``) costs a refit, in
one process (a direct-mode engine, no fleet): refits from a directory and from tensors in memory, each with the
check and with it switched off (the code before the check), alternating, as bytes per second of the checkpoint;
and the check alone over the same tensors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from megatron_serve import InferenceConfig, MegatronLLM, SamplingParams
from megatron_serve.model import finite
from megatron_serve.weights import sources
from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.fleet.local_fleet import LocalFleet
from megatron_serve.model.tiny import make_tiny_model

from cli_options import add_number_options

#: The engine options of :func:`one_engine_fleet`'s engines, as a replacement engine's command line says them.
FLEET_ARGS = ["--num-kv-blocks", "64", "--max-sequence-length", "256"]
ONE_TOKEN = SamplingParams(temperature=0.0, num_tokens_to_generate=1, ignore_eos=True)


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


async def first_request(client: InferenceClient) -> float:
    started = time.perf_counter()
    result = await client.add_request("refit benchmark: the quick brown fox", ONE_TOKEN)
    if result.status.value != "COMPLETED":
        raise RuntimeError(f"request failed: {result.error}")
    return time.perf_counter() - started


async def paused_update(client: InferenceClient, update: Callable[[], Awaitable[dict[str, Any]]]
                        ) -> tuple[dict[str, Any], dict[str, float]]:
    """``update()`` between a pause and an unpause, as a trainer's weight update goes; returns its ack and the seconds
    of each phase: ``pause``, ``update``, ``unpause``, the ``first request`` after it, and their ``total``."""
    t0 = time.perf_counter()
    await client.pause()
    t1 = time.perf_counter()
    ack = await update()
    t2 = time.perf_counter()
    await client.unpause()
    t3 = time.perf_counter()
    first = await first_request(client)
    return ack, {"pause": t1 - t0, "update": t2 - t1, "unpause": t3 - t2, "first request": first,
                 "total": t3 - t0 + first}


async def refit_round(client: InferenceClient, source: str) -> dict[str, float]:
    ack, took = await paused_update(client, lambda: client.refit(source))
    (facts,) = ack["detail"]["engines"].values()
    return {"pause": took["pause"], "refit": took["update"], "  engine: verify (shapes, finite)": facts["verified_s"],
            "  engine: load in place": facts["load_s"], "unpause": took["unpause"],
            "first request": took["first request"], "total": took["total"]}


async def restart_round(client: InferenceClient, fleet: LocalFleet, source: str, config_args: list[str]) -> dict:
    old = fleet.engines[-1]
    before = {e["id"] for e in (await client.status())["engines"]}
    t0 = time.perf_counter()
    old.terminate()  # SIGTERM: DRAINING, hand back, exit
    await asyncio.to_thread(old.wait, 120)
    t1 = time.perf_counter()
    fleet.model_dir = source  # the replacement starts from the new weights
    fleet.add_engine(group=0, extra=config_args)
    while True:
        engines = (await client.status())["engines"]
        if any(e["id"] not in before for e in engines):
            break
        fleet.check_alive()
        await asyncio.sleep(0.05)
    t2 = time.perf_counter()
    first = await first_request(client)
    return {"stop old process (drain, exit)": t1 - t0, "start new process, load, register": t2 - t1,
            "first request": first, "total": t2 - t0 + first}


def write_checkpoints(args: argparse.Namespace, prefix: str) -> list[str]:
    """Two random checkpoints of the shape ``args`` asks for (kept in ``--dir`` when given)."""
    root = Path(args.dir or tempfile.mkdtemp(prefix=prefix))
    shape = dict(hidden_size=args.hidden_size, num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                 intermediate_size=args.intermediate_size)
    paths = []
    for seed in (0, 1):
        path = root / f"ckpt{seed}"
        if not (path / "config.json").exists():
            print(f"writing checkpoint {path} ...", file=sys.stderr)
            make_tiny_model(path, seed=seed, **shape)
        paths.append(str(path))
    return paths


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def phase_table(title: str, rows: list[dict]) -> None:
    """One Markdown table: each phase's median seconds."""
    print(f"\n| {title:<36} | {'seconds':>8} |")
    print(f"|{'-' * 38}|{'-' * 10}|")
    for key in rows[0]:
        print(f"| {key:<36} | {median(rows, key):>8.3f} |")


@contextlib.asynccontextmanager
async def one_engine_fleet(model_dir: str) -> AsyncIterator[tuple[LocalFleet, InferenceClient]]:
    """A local fleet of one engine of ``model_dir`` (:data:`FLEET_ARGS`) and a client of it, past a warm-up request;
    both stopped after."""
    fleet = LocalFleet(model_dir, 1, InferenceConfig(num_kv_blocks=64, max_sequence_length=256))
    try:
        address = await asyncio.to_thread(fleet.start, 300)
        client = InferenceClient(address, token=fleet.token)
        await client.start(timeout=60)
        try:
            await client.wait_for_engines(1, timeout=600)
            await first_request(client)  # warm-up
            yield fleet, client
        finally:
            client.close()
    finally:
        await asyncio.to_thread(fleet.stop, 60)


async def main_async(args: argparse.Namespace) -> None:
    paths = write_checkpoints(args, "megatron-refit-bench-")
    size = checkpoint_bytes(Path(paths[0]))
    refits: list[dict] = []
    restarts: list[dict] = []
    async with one_engine_fleet(paths[0]) as (fleet, client):
        # restarts first: the coordinator then has no refit on record to sync new engines to
        for i in range(args.rounds):
            restarts.append(await restart_round(client, fleet, paths[(i + 1) % 2], FLEET_ARGS))
        current = (args.rounds % 2)
        for i in range(args.rounds):
            refits.append(await refit_round(client, paths[(current + i + 1) % 2]))

    print(f"\nrefit vs restart, {size / 2**20:.0f} MiB fp32 checkpoint ({args.layers} layers, hidden "
          f"{args.hidden_size}), CPU, {os.cpu_count()} cores, median of {args.rounds}")
    phase_table("in-place refit phase", refits)
    phase_table("engine restart phase", restarts)
    speedup = median(restarts, "total") / median(refits, "total")
    print(f"\nnew weights serving after {median(refits, 'total'):.2f} s in place vs {median(restarts, 'total'):.2f} s "
          f"by restart ({speedup:.1f}x)")


def finite_check_cost(args: argparse.Namespace) -> None:
    """Refit bytes/s with the finite check and without it (``--finite-check``), alternating, in one process."""
    paths = write_checkpoints(args, "megatron-refit-bench-")
    size = checkpoint_bytes(Path(paths[0]))
    in_memory = [list(load_file(Path(p) / "model.safetensors").items()) for p in paths]
    checked = sources.refuse_nonfinite
    rows: dict[str, list[float]] = {}
    with MegatronLLM(paths[0], InferenceConfig(num_kv_blocks=16, max_sequence_length=64)) as llm:
        for i in range(args.rounds):
            for check in (False, True) if i % 2 == 0 else (True, False):
                sources.refuse_nonfinite = checked if check else (lambda named, what: None)
                label = "with the check" if check else "without (before)"
                started = time.perf_counter()
                llm.refit(paths[(i + 1) % 2])
                rows.setdefault(f"directory refit, {label}", []).append(size / (time.perf_counter() - started))
                started = time.perf_counter()
                llm.refit(in_memory[i % 2])
                rows.setdefault(f"in-memory refit, {label}", []).append(size / (time.perf_counter() - started))
        sources.refuse_nonfinite = checked
    for _ in range(args.rounds):
        started = time.perf_counter()
        assert finite.first_nonfinite(in_memory[0]) is None
        rows.setdefault("the check alone", []).append(size / (time.perf_counter() - started))
    print(f"\nfinite check on refits, {size / 2**20:.0f} MiB fp32 checkpoint ({args.layers} layers, hidden "
          f"{args.hidden_size}), CPU, torch threads {torch.get_num_threads()}, median of {args.rounds}")
    print(f"\n| {'path':<36} | {'GB/s':>7} |\n|{'-' * 38}|{'-' * 9}|")
    for key, values in sorted(rows.items()):
        print(f"| {key:<36} | {statistics.median(values) / 1e9:>7.3f} |")
    for path in ("directory", "in-memory"):
        ratio = statistics.median(rows[f"{path} refit, with the check"]) / statistics.median(
            rows[f"{path} refit, without (before)"])
        print(f"{path} refit with the check: {ratio:.2f}x the bytes/s without it")


def add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    """The checkpoint's shape (default ~360 MB in fp32), where it lives, and how many rounds to time."""
    parser.add_argument("--dir", help="where to write (or find) the checkpoints (default: a temporary directory)")
    add_number_options(parser, hidden_size=1024, layers=8, heads=16, kv_heads=4, intermediate_size=2816, rounds=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_options(parser)
    parser.add_argument("--finite-check", action="store_true",
                        help="measure the NaN/Inf check's cost on refits (one process) instead of refit vs restart")
    args = parser.parse_args()
    if args.finite_check:
        finite_check_cost(args)
    else:
        asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
