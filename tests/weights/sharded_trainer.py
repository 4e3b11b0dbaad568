"""One rank of a sharded trainer for the sharded-refit tests: cut a checkpoint as Megatron would hold it, send the pieces.

``python sharded_trainer.py ADDRESS MODEL_DIR EPOCH RANK WORLD_SIZE TRAINER_PORT [options]`` (the fleet secret
in ``$MEGATRON_SERVE_TOKEN``). Every rank loads the checkpoint's tensors and keeps only its own pieces
(:func:`cut`), joins the trainer's own gloo group on ``TRAINER_PORT``, and calls ``WeightSender.send`` with them.
It prints JSON lines: ``{"largest", "holds"}`` (bytes of the largest tensor this rank keeps, of all of them), each bucket's progress, then
the acknowledgement or ``{"error", "type"}``; exit 0 on an acknowledgement.

Options: ``--delta``; ``--bucket-bytes N``; ``--timeout S``; ``--die-after-bucket N`` (SIGKILL after bucket N
left, like a crashed rank); ``--overlap`` / ``--gap`` / ``--wrong-shape`` (rank 1 sends a bad piece);
``--change-layer L`` (add 1 to every weight of layer L before sending).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import signal

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megatron_serve import InferenceClient, Shard, WeightSender, WeightTransferError
from megatron_serve.client.coordinator_client import ControlError

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")  # cut by rows
ROW = ("o_proj", "down_proj")  # cut by columns
EXPERT = re.compile(r"\.experts\.(\d+)\.")


def cut(name: str, tensor: torch.Tensor, rank: int, world_size: int) -> list[tuple]:
    """This rank's pieces of one tensor: experts whole by ``expert % world_size`` (expert parallel),
    column-parallel and vocabulary weights by rows, row-parallel ones by columns, the rest (norms, routers)
    whole on rank 0."""
    expert = EXPERT.search(name)
    if expert is not None:
        return [(name, tensor)] if int(expert.group(1)) % world_size == rank else []
    leaf = name.split(".")[-2]
    dim = 0 if leaf in COLUMN else 1 if leaf in ROW else None
    if dim is None:
        return [(name, tensor)] if rank == 0 else []
    size = tensor.shape[dim]
    start, stop = size * rank // world_size, size * (rank + 1) // world_size
    offset = [0] * tensor.dim()
    offset[dim] = start
    return [(name, tensor.narrow(dim, start, stop - start).clone(), Shard(tuple(tensor.shape), tuple(offset)))]


def pieces(args: argparse.Namespace) -> list[tuple]:
    state = load_file(os.path.join(args.model, "model.safetensors"))
    if args.change_layer is not None:
        marker = f"model.layers.{args.change_layer}."
        state = {n: t + 1 if n.startswith(marker) else t for n, t in state.items()}
    out = []
    for name in sorted(state):
        out.extend(cut(name, state[name], args.rank, args.world_size))
    del state  # this rank keeps only its own pieces from here on
    if args.rank == 1 and (args.overlap or args.gap or args.wrong_shape):
        index = next(i for i, item in enumerate(out) if len(item) == 3 and item[2].offset[0] > 0)
        name, local, shard = out[index]
        if args.overlap:  # one row more, reaching into rank 0's rows
            full = load_file(os.path.join(args.model, "model.safetensors"))[name]
            first = shard.offset[0] - 1
            out[index] = (name, full[first:first + local.shape[0] + 1].clone(), Shard(shard.full_shape, (first, 0)))
        elif args.gap:  # one row fewer
            out[index] = (name, local[1:].clone(), Shard(shard.full_shape, (shard.offset[0] + 1, 0)))
        else:
            out[index] = (name, local, Shard((shard.full_shape[0] + 2, *shard.full_shape[1:]), shard.offset))
    return out


async def main(args: argparse.Namespace) -> int:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.trainer_port}", rank=args.rank,
                            world_size=args.world_size, timeout=datetime.timedelta(seconds=120))
    mine = pieces(args)
    sizes = [item[1].numel() * item[1].element_size() for item in mine]
    print(json.dumps({"largest": max(sizes), "holds": sum(sizes)}), flush=True)

    def on_bucket(index: int, count: int, nbytes: int) -> None:
        print(json.dumps({"bucket": index + 1, "of": count}), flush=True)
        if args.die_after_bucket is not None and index + 1 >= args.die_after_bucket:
            os.kill(os.getpid(), signal.SIGKILL)

    async with InferenceClient(args.address, token=os.environ.get("MEGATRON_SERVE_TOKEN")) as client:
        sender = WeightSender(client, backend="gloo", bucket_bytes=args.bucket_bytes, rank=args.rank,
                              world_size=args.world_size, timeout=args.timeout, on_bucket=on_bucket)
        try:
            ack = await sender.send(mine, epoch=args.epoch, delta=args.delta)
        except (ControlError, WeightTransferError, ValueError) as exc:
            print(json.dumps({"error": str(exc), "type": type(exc).__name__}), flush=True)
            return 1
    print(json.dumps(ack), flush=True)
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
    raise SystemExit(asyncio.run(main(parser.parse_args())))
