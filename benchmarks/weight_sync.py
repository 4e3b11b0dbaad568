"""New weights from a trainer: collective transfer vs directory refit vs restarting the engine.

Two random checkpoints of the same architecture (a few hundred MB, fp32) are written once; a
local fleet (coordinator + one engine process) serves the first. Then, alternating between them,
the time until the new weights answer a request:

* **restart**: SIGTERM the engine, start one on the other checkpoint, wait for it to register
  (what rolling a pod costs at best);
* **directory refit**: the trainer writes its tensors as a checkpoint (safetensors, to local disk,
  no fsync: the best case), then PAUSE, REFIT from that directory (every engine verifies, then
  loads it), UNPAUSE;
* **collective refit**: PAUSE, :class:`~megatron_serve.WeightSender` from this process
  (the "trainer", holding the tensors in memory) over gloo, UNPAUSE.

Beside the collective's bytes/s: this machine's memory copy bandwidth (``torch`` copying a buffer
of the checkpoint's size), measured in the same run, which bounds what any in-host transfer can
reach. Medians of ``--rounds``; restarts first, then directory refits, then collective ones (after a
collective refit a new engine waits for the next refit, so restarts cannot follow it).

    python benchmarks/weight_sync.py                      # ~360 MB fp32 checkpoints on CPU
    python benchmarks/weight_sync.py --bucket-mib 64 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve import WeightSender

sys.path.insert(0, str(Path(__file__).parent))
from refit import (  # noqa: E402
    FLEET_ARGS,
    add_checkpoint_options,
    checkpoint_bytes,
    median,
    one_engine_fleet,
    paused_update,
    phase_table,
    refit_round,
    restart_round,
    write_checkpoints,
)


def memory_copy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of one ``copy_`` between two host buffers of ``nbytes`` (median of ``repeats``)."""
    source = torch.ones(nbytes // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    target.copy_(source)  # touch every page first
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times)


def trainer_tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    """The "trainer's" weights, in memory (read once, not timed)."""
    return list(load_file(str(Path(path) / "model.safetensors")).items())


def checkpoint_dir(model: str, target: Path) -> str:
    """A directory holding ``model``'s config and tokenizer, where the trainer writes its weights."""
    target.mkdir(parents=True, exist_ok=True)
    for item in Path(model).iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, target / item.name)
    return str(target)


async def directory_round(client: InferenceClient, named: list[tuple[str, torch.Tensor]], target: str
                          ) -> dict[str, float]:
    started = time.perf_counter()
    await asyncio.to_thread(save_file, dict(named), str(Path(target) / "model.safetensors"))
    written = time.perf_counter() - started
    phases = await refit_round(client, target)
    return {"trainer writes the checkpoint": written, **phases, "total": written + phases["total"]}


async def collective_round(client: InferenceClient, named: list[tuple[str, torch.Tensor]], bucket_bytes: int
                           ) -> dict[str, float]:
    sender = WeightSender(client, backend="gloo", bucket_bytes=bucket_bytes)
    ack, took = await paused_update(client, lambda: sender.send(named))
    (facts,) = ack["detail"]["engines"].values()
    sent = ack["detail"]["sender"]
    return {"pause": took["pause"], "send": took["update"], "  sender: engines join": sent["rendezvous_s"],
            "  sender: send buckets": sent["transfer_s"], "  engine: verify manifest": facts["verified_s"],
            "  engine: receive and load": facts["load_s"], "unpause": took["unpause"],
            "first request": took["first request"], "total": took["total"]}


async def main_async(args: argparse.Namespace) -> None:
    paths = write_checkpoints(args, "megatron-weight-sync-bench-")
    size = checkpoint_bytes(Path(paths[0]))
    bandwidth = memory_copy_bandwidth(size)
    tensors = [trainer_tensors(p) for p in paths]
    written = [checkpoint_dir(paths[0], Path(paths[0]).parent / f"written{i}") for i in (0, 1)]
    restarts: list[dict] = []
    refits: list[dict] = []
    sends: list[dict] = []
    async with one_engine_fleet(paths[0]) as (fleet, client):
        load = os.getloadavg()[0]
        serving = 0
        for _ in range(args.rounds):
            serving = 1 - serving
            restarts.append(await restart_round(client, fleet, paths[serving], FLEET_ARGS))
        for _ in range(args.rounds):
            serving = 1 - serving
            refits.append(await directory_round(client, tensors[serving], written[serving]))
        for _ in range(args.rounds):
            serving = 1 - serving
            sends.append(await collective_round(client, tensors[serving], args.bucket_mib << 20))

    print(f"\nweight sync, {size / 2**20:.0f} MiB fp32 ({args.layers} layers, hidden {args.hidden_size}), CPU, "
          f"{os.cpu_count()} cores, gloo, {args.bucket_mib} MiB buckets, median of {args.rounds}, "
          f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
    phase_table("collective refit phase", sends)
    phase_table("directory refit phase", refits)
    phase_table("engine restart phase", restarts)
    sending = median(sends, "  sender: send buckets")
    print(f"\n| {'new weights serving by':<24} | {'seconds':>8} | {'vs collective':>13} |")
    print(f"|{'-' * 26}|{'-' * 10}|{'-' * 15}|")
    for name, rows in (("collective refit", sends), ("write + directory refit", refits), ("engine restart", restarts)):
        total = median(rows, "total")
        print(f"| {name:<24} | {total:>8.3f} | {total / median(sends, 'total'):>12.1f}x |")
    print(f"\ncollective refit: {size / sending / 1e9:.2f} GB/s; this machine's memory copy: "
          f"{bandwidth / 1e9:.2f} GB/s (sent at {size / sending / bandwidth:.0%} of it)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_options(parser)
    parser.add_argument("--bucket-mib", type=int, default=512)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
