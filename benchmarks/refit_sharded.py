"""A sharded trainer's refit: bytes/s per link against this machine's memory copy, and the
time to refit against the model's size for trainer world sizes 1, 2 and 4.

For each checkpoint size (``--sizes``: hidden sizes; layers and the rest as ``refit.py``'s options) a local fleet
(coordinator + one engine process, tensor-parallel ``--engine-tp``) serves it; for each world size, that many
trainer processes each hold their pieces (column-parallel weights cut by rows, row-parallel ones by columns, the
vocabulary by rows, norms on rank 0, as ``megatron_serve.weights.megatron_core.tp_piece`` cuts them) and call
``WeightSender.send`` side by side, ``--rounds`` times. Reported (medians): the time from the first ``send`` to
the acknowledgement, the transfer's own seconds (rank 0), and each engine rank's bytes/s (every trainer rank's
link to it at once), beside one host-to-host ``copy_`` of the same bytes.

    python benchmarks/refit_sharded.py --sizes 256,512,1024 --world-sizes 1,2,4
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megatron_serve import InferenceConfig, WeightSender
from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.fleet.local_fleet import LocalFleet, free_port
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.weights.megatron_core import tp_piece

sys.path.insert(0, str(Path(__file__).parent))
from refit import add_checkpoint_options  # noqa: E402
from weight_sync import memory_copy_bandwidth  # noqa: E402

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW = ("o_proj", "down_proj")


def cut(name: str, tensor: torch.Tensor, rank: int, world_size: int) -> list:
    """This rank's piece of one tensor (a trainer sharded ``world_size`` ways by tensor parallelism)."""
    leaf = name.split(".")[-2]
    dim = 0 if leaf in COLUMN else 1 if leaf in ROW else None
    if dim is None or world_size == 1:
        return [(name, tensor)] if rank == 0 else []
    size = tensor.shape[dim] // world_size
    return [tp_piece(name, tensor.narrow(dim, rank * size, size).clone(), dim, rank, world_size)]


def trainer_rank(address: str, token: str, model: str, rank: int, world_size: int, port: int, rounds: int,
                 bucket_bytes: int, results: "multiprocessing.Queue") -> None:
    """One trainer rank: join the trainer's group, keep its pieces, send them ``rounds`` times."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=300))
    state = load_file(str(Path(model) / "model.safetensors"))
    mine = [item for name in sorted(state) for item in cut(name, state[name], rank, world_size)]
    del state

    async def run() -> None:
        async with InferenceClient(address, token=token) as client:
            sender = WeightSender(client, backend="gloo", bucket_bytes=bucket_bytes, rank=rank,
                                  world_size=world_size, timeout=300)
            for epoch in range(rounds):
                if rank == 0:
                    await client.pause()
                dist.barrier()
                started = time.perf_counter()
                ack = await sender.send(mine, epoch=100 + epoch)
                results.put((rank, time.perf_counter() - started, ack["detail"]))
                if rank == 0:
                    await client.unpause()

    asyncio.run(run())
    dist.destroy_process_group()


def one_size(args: argparse.Namespace, hidden: int) -> list[dict]:
    root = Path(args.dir or "/tmp") / f"megatron-refit-sharded-{hidden}"
    if not (root / "config.json").exists():
        make_tiny_model(root, seed=0, hidden_size=hidden, num_layers=args.layers, num_heads=args.heads,
                        num_kv_heads=args.kv_heads, intermediate_size=hidden * 11 // 4)
    size = (root / "model.safetensors").stat().st_size
    fleet = LocalFleet(str(root), 1, InferenceConfig(num_kv_blocks=64, max_sequence_length=256,
                                                     tensor_parallel_size=args.engine_tp))
    address = fleet.start(600)
    rows = []
    try:
        asyncio.run(_wait(address, fleet.token))
        context = multiprocessing.get_context("spawn")
        for world_size in args.world_sizes:
            results = context.Queue()
            port = free_port("127.0.0.1")
            procs = [context.Process(target=trainer_rank, args=(address, fleet.token, str(root), rank, world_size,
                                                                port, args.rounds, args.bucket_mib << 20, results))
                     for rank in range(world_size)]
            for proc in procs:
                proc.start()
            answers = [results.get(timeout=900) for _ in range(world_size * args.rounds)]
            for proc in procs:
                proc.join(120)
            lead = [(seconds, detail) for rank, seconds, detail in answers if rank == 0]
            receivers = [f for _, detail in lead for f in detail["receivers"].values()]
            rows.append({"MiB": size / 2**20, "world size": world_size,
                         "send s": statistics.median(s for s, _ in lead),
                         "transfer s": statistics.median(d["sender"]["transfer_s"] for _, d in lead),
                         "link GB/s": statistics.median(f["bytes_per_s"] for f in receivers) / 1e9})
    finally:
        fleet.stop(60)
    return rows


async def _wait(address: str, token: str) -> None:
    async with InferenceClient(address, token=token) as client:
        await client.wait_for_engines(1, timeout=600)


def run(args: argparse.Namespace) -> None:
    rows = [row for hidden in args.sizes for row in one_size(args, hidden)]
    copy = memory_copy_bandwidth(int(max(r["MiB"] for r in rows) * 2**20))
    print(f"\nsharded refit, fp32, CPU ({os.cpu_count()} cores), gloo, {args.bucket_mib} MiB buckets, one engine of "
          f"tensor parallel {args.engine_tp}, median of {args.rounds}; this machine's memory copy {copy / 1e9:.2f} GB/s")
    print(f"\n| {'MiB':>7} | {'trainer ranks':>13} | {'send (s)':>8} | {'transfer (s)':>12} | {'per engine rank GB/s':>20} "
          f"| {'vs memory copy':>14} |")
    print(f"|{'-' * 9}|{'-' * 15}|{'-' * 10}|{'-' * 14}|{'-' * 22}|{'-' * 16}|")
    for r in rows:
        print(f"| {r['MiB']:>7.0f} | {r['world size']:>13} | {r['send s']:>8.3f} | {r['transfer s']:>12.3f} | "
              f"{r['link GB/s']:>20.2f} | {r['link GB/s'] * 1e9 / copy:>13.0%} |")


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[256, 512],
                        help="hidden sizes of the checkpoints (comma-separated)")
    parser.add_argument("--world-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--engine-tp", type=int, default=1)
    parser.add_argument("--bucket-mib", type=int, default=32)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_options(parser)
    add_options(parser)
    run(parser.parse_args())
