"""One rank of a sharded trainer for the sharded-refit tests: cut a checkpoint as Megatron would hold it, send the pieces.

``python sharded_trainer.py ADDRESS MODEL_DIR EPOCH RANK WORLD_SIZE TRAINER_PORT [options]`` (the fleet secret
in ``$MEGATRON_SERVE_TOKEN``). Every rank reads only its own pieces of the checkpoint's tensors (:func:`cut`),
joins the trainer's own gloo group on ``TRAINER_PORT``, and calls ``WeightSender.send`` with them. It prints JSON
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
import re
import signal
import time

import torch
import torch.distributed as dist

from megatron_serve import InferenceClient, Shard, WeightSender, WeightTransferError
from megatron_serve.client.coordinator_client import ControlError
from megatron_serve.weights.peak import peak_since, start_peak

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")  # cut by rows
ROW = ("o_proj", "down_proj")  # cut by columns
EXPERT = re.compile(r"\.experts\.(\d+)\.")


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class Stored:
    """One tensor of a safetensors file, read in rectangles with plain reads into this process's own memory (as a
    trainer holds its shards): a mapped file (``safe_open``) would also count the pages it touched in the
    process's peak, beside any copy of them."""

    def __init__(self, fd: int, base: int, entry: dict) -> None:
        self.fd, self.dtype, self.shape = fd, _DTYPES[entry["dtype"]], tuple(entry["shape"])
        self.start = base + entry["data_offsets"][0]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        """The rectangle of plain slices ``index`` on the first two dims (the others whole): one read for whole rows,
        else one per row."""
        index = index if isinstance(index, tuple) else (index,)
        rows, cols = ((index[d] if d < len(index) else slice(None)).indices(self.shape[d])[:2]
                      if d < len(self.shape) else (0, 1) for d in (0, 1))
        out = torch.empty((rows[1] - rows[0], *self.shape[1:]), dtype=self.dtype)
        if len(self.shape) > 1:
            out = torch.empty((rows[1] - rows[0], cols[1] - cols[0], *self.shape[2:]), dtype=self.dtype)
        column = torch.Size(self.shape[2:]).numel() * self.dtype.itemsize
        row = column * (self.shape[1] if len(self.shape) > 1 else 1)
        data = out.view(-1).view(torch.uint8).numpy()
        if cols[1] - cols[0] == (self.shape[1] if len(self.shape) > 1 else 1):
            os.preadv(self.fd, [data], self.start + rows[0] * row)
            return out
        width = (cols[1] - cols[0]) * column
        for r in range(rows[1] - rows[0]):
            os.preadv(self.fd, [data[r * width:(r + 1) * width]], self.start + (rows[0] + r) * row + cols[0] * column)
        return out


class Checkpoint:
    """The tensors of one ``model.safetensors``, each a :class:`Stored` (read only where asked)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        length = int.from_bytes(os.pread(self.fd, 8, 0), "little")
        self.header = {k: v for k, v in json.loads(os.pread(self.fd, length, 8)).items() if k != "__metadata__"}
        self.base = 8 + length

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    def keys(self) -> list[str]:
        return list(self.header)

    def get_slice(self, name: str) -> Stored:
        return Stored(self.fd, self.base, self.header[name])

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.get_slice(name)[:]


def cut(name: str, source, rank: int, world_size: int) -> list[tuple]:
    """This rank's pieces of one tensor (a tensor, or a safetensors slice: only the piece is read): experts whole by
    ``expert % world_size`` (expert parallel), column-parallel and vocabulary weights by rows, row-parallel ones by
    columns, the rest (norms, routers) whole on rank 0."""
    shape = tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)
    expert = EXPERT.search(name)
    if expert is not None:
        return [(name, source[:])] if int(expert.group(1)) % world_size == rank else []
    leaf = name.split(".")[-2]
    dim = 0 if leaf in COLUMN else 1 if leaf in ROW else None
    if dim is None:
        return [(name, source[:])] if rank == 0 else []
    start, stop = shape[dim] * rank // world_size, shape[dim] * (rank + 1) // world_size
    offset = [0] * len(shape)
    offset[dim] = start
    local = source[(slice(None),) * dim + (slice(start, stop),)]
    return [(name, local.clone() if isinstance(source, torch.Tensor) else local, Shard(shape, tuple(offset)))]


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
        return [piece for name in sorted(checkpoint.keys()) if checkpoint.header[name]["dtype"] in _DTYPES
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

    def on_bucket(index: int, count: int, nbytes: int) -> None:
        print(json.dumps({"bucket": index + 1, "of": count, "at": time.time()}), flush=True)
        if args.die_after_bucket is not None and index + 1 >= args.die_after_bucket:
            os.kill(os.getpid(), signal.SIGKILL)

    # a control client: the verbs and STATUS a trainer sends, without the tokenizer a client that submits loads
    async with InferenceClient(args.address, token=os.environ.get("MEGATRON_SERVE_TOKEN"), role="control") as client:
        # this rank's memory from here on (the client is the trainer's own): the pieces it reads, and all that
        # sending them costs
        baseline = start_peak(trim=True)
        mine = pieces(args)
        sizes = [item[1].numel() * item[1].element_size() for item in mine]
        print(json.dumps({"largest": max(sizes), "holds": sum(sizes)}), flush=True)
        sender = WeightSender(client, backend="gloo", bucket_bytes=args.bucket_bytes, rank=args.rank,
                              world_size=args.world_size, timeout=args.timeout, on_bucket=on_bucket)
        name, _, adapter = (args.adapter or "").partition("=")
        try:
            ack = await sender.send(mine, epoch=args.epoch, delta=args.delta, drafter=drafter_pieces(args),
                                    adapters={name: adapter} if adapter and args.rank == args.world_size - 1 else None)
        except (ControlError, WeightTransferError, ValueError) as exc:
            print(json.dumps({"error": str(exc), "type": type(exc).__name__, "at": time.time()}), flush=True)
            return 1
        peak = peak_since(baseline)
    print(json.dumps({**ack, "peak_rss_bytes": peak}), flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("model")
    parser.add_argument("epoch", type=int)
    parser.add_argument("rank", type=int)
    parser.add_argument("world_size", type=int)
    parser.add_argument("trainer_port", type=int)
    parser.add_argument("--bucket-bytes", type=int, default=64 << 10)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--delta", action="store_true")
    parser.add_argument("--die-after-bucket", type=int, default=None)
    parser.add_argument("--change-layer", type=int, default=None)
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--gap", action="store_true")
    parser.add_argument("--wrong-shape", action="store_true")
    parser.add_argument("--grow", default=None)
    parser.add_argument("--gather", default=None)
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--adapter", default=None)
    raise SystemExit(asyncio.run(main(parser.parse_args())))
