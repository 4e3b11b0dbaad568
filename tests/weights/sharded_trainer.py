"""One rank of a sharded trainer for the sharded-refit tests: cut a checkpoint as Megatron would hold it, send the pieces.

``python sharded_trainer.py ADDRESS MODEL_DIR EPOCH RANK WORLD_SIZE TRAINER_PORT [options]`` (the fleet secret
in ``$MEGATRON_SERVE_TOKEN``). Every rank reads only its own pieces of the checkpoint's tensors
(:func:`checkpoint_cuts.cut`), joins the trainer's own gloo group on ``TRAINER_PORT``, and calls
``WeightSender.send`` with them. It prints JSON
lines: ``{"largest", "holds"}`` (bytes of the largest tensor this rank keeps, of all of them), each bucket's
progress (``at``: when it left, ``time.time()``), then the acknowledgement with ``peak_rss_bytes`` (how far this
process's resident memory rose from before it read its pieces to the acknowledgement,
:mod:`megatron_serve.weights.peak`) or ``{"error", "type", "at"}`` (``at``: when ``send`` raised); exit 0 on an
acknowledgement.

Options: ``--delta``; ``--bucket-bytes N``; ``--timeout S``; ``--die-after-bucket N`` (SIGKILL after bucket N
left, like a crashed rank); ``--overlap`` / ``--gap`` / ``--wrong-shape`` (rank 1 sends a bad piece);
``--change-layer L`` (add 1 to every weight of layer L before sending); ``--grow NAME`` (every rank cuts tensor NAME
with two more rows: a full shape all ranks agree on that the model does not have); ``--gather NAME`` (the control
of the memory figures: rank 0 gathers tensor NAME whole and sends it, as a trainer without pieces must);
``--drafter DIR`` (an EAGLE-3 head's tensors too, cut as the policy's, in the same send); ``--adapter NAME=DIR``
(the last rank adds a PEFT adapter directory as adapter NAME, in the same send).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os

import torch
import torch.distributed as dist

from checkpoint_cuts import DTYPES, Checkpoint, cut  # beside this script (its folder: sys.path[0])
from megatron_serve import Shard, WeightSender, WeightTransferError
from megatron_serve.client.coordinator_client import ControlError
from megatron_serve.weights.peak import peak_since, start_peak
from trainer_cli import bucket_report, control_client, print_refusal, trainer_arguments


def pieces(args: argparse.Namespace) -> list[tuple]:
    """This rank's pieces, read from the checkpoint piece by piece (the rank never holds a full tensor it does not
    send), altered as the options say."""
    out = []
    with Checkpoint(os.path.join(args.model, "model.safetensors")) as checkpoint:
        for name in sorted(checkpoint.keys()):
            source = checkpoint.get_slice(name)
            if args.change_layer is not None and name.startswith(f"model.layers.{args.change_layer}."):
                source = checkpoint.get_tensor(name) + 1
            elif name == args.grow:  # every rank agrees on a full shape that is not the model's
                full = checkpoint.get_tensor(name)
                source = torch.cat([full, full[:2]])
            out.extend(cut(name, source, args.rank, args.world_size))
        if args.rank == 1 and (args.overlap or args.gap or args.wrong_shape):
            index = next(i for i, item in enumerate(out) if len(item) == 3 and item[2].offset[0] > 0)
            name, local, shard = out[index]
            if args.overlap:  # one row more, reaching into rank 0's rows
                first = shard.offset[0] - 1
                out[index] = (name, checkpoint.get_slice(name)[first:first + local.shape[0] + 1],
                              Shard(shard.full_shape, (first, 0)))
            elif args.gap:  # one row fewer
                out[index] = (name, local[1:], Shard(shard.full_shape, (shard.offset[0] + 1, 0)))
            else:
                out[index] = (name, local, Shard((shard.full_shape[0] + 2, *shard.full_shape[1:]), shard.offset))
    if args.gather is not None:  # the control: gather one tensor whole onto rank 0, as a sender without pieces must
        out = gathered(out, args.gather, args.rank, args.world_size)
    return out


def drafter_pieces(args: argparse.Namespace) -> list[tuple]:
    """This rank's pieces of the drafter's checkpoint (an EAGLE-3 head: its floating-point tensors, cut as the
    policy's; the integer vocabulary maps stay with the head)."""
    if args.drafter is None:
        return []
    with Checkpoint(os.path.join(args.drafter, "model.safetensors")) as checkpoint:
        return [piece for name in sorted(checkpoint.keys()) if checkpoint.header[name]["dtype"] in DTYPES
                for piece in cut(name, checkpoint.get_slice(name), args.rank, args.world_size)]


def gathered(out: list[tuple], name: str, rank: int, world_size: int) -> list[tuple]:
    """``out`` with tensor ``name``'s row pieces gathered over the trainer's group into one full tensor on rank 0."""
    index = next(i for i, item in enumerate(out) if item[0] == name)
    _, local, shard = out.pop(index)
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local.contiguous())
    return [*out, (name, torch.cat(parts))] if rank == 0 else out


async def main(args: argparse.Namespace) -> int:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.trainer_port}", rank=args.rank,
                            world_size=args.world_size, timeout=datetime.timedelta(seconds=120))
    async with control_client(args.address) as client:
        # this rank's memory from here on (the client is the trainer's own): the pieces it reads, and all that
        # sending them costs
        baseline = start_peak(trim=True)
        mine = pieces(args)
        sizes = [item[1].numel() * item[1].element_size() for item in mine]
        print(json.dumps({"largest": max(sizes), "holds": sum(sizes)}), flush=True)
        sender = WeightSender(client, backend="gloo", bucket_bytes=args.bucket_bytes, rank=args.rank,
                              world_size=args.world_size, timeout=args.timeout, on_bucket=bucket_report(args))
        name, _, adapter = (args.adapter or "").partition("=")
        try:
            ack = await sender.send(mine, epoch=args.epoch, delta=args.delta, drafter=drafter_pieces(args),
                                    adapters={name: adapter} if adapter and args.rank == args.world_size - 1 else None)
        except (ControlError, WeightTransferError, ValueError) as exc:
            print_refusal(exc)
            return 1
        peak = peak_since(baseline)
    print(json.dumps({**ack, "peak_rss_bytes": peak}), flush=True)
    return 0


if __name__ == "__main__":
    parser = trainer_arguments(timeout=60.0)
    parser.add_argument("rank", type=int)
    parser.add_argument("world_size", type=int)
    parser.add_argument("trainer_port", type=int)
    parser.add_argument("--bucket-bytes", type=int, default=64 << 10)
    parser.add_argument("--delta", action="store_true")
    parser.add_argument("--change-layer", type=int, default=None)
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--gap", action="store_true")
    parser.add_argument("--wrong-shape", action="store_true")
    parser.add_argument("--grow", default=None)
    parser.add_argument("--gather", default=None)
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--adapter", default=None)
    raise SystemExit(asyncio.run(main(parser.parse_args())))
