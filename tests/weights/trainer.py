"""A trainer process for the weight-sync tests: push a Hugging Face checkpoint's weights into a fleet.

``python trainer.py ADDRESS MODEL_DIR EPOCH BUCKET_BYTES [options]`` (the fleet secret in ``$MEGATRON_SERVE_TOKEN``)
prints a line per bucket sent, then one JSON line (the acknowledgement, or the error), and exits 0 when the fleet
acknowledged. The options (:func:`trainer_cli.trainer_arguments`): ``--die-after-bucket N`` (a crashed trainer),
``--hold-after-bucket N`` (stopped there, alive: the moment a partition test cuts its link), ``--timeout S``.

The weights are the checkpoint's tensors as float32, by the names a ``transformers`` model's ``named_parameters()``
gives them (a tiny model's file holds exactly those): read straight from the file, since importing transformers
and building its model cost each trainer process ~4 s of CPU, more than the transfer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from megatron_serve.client.coordinator_client import ControlError
from megatron_serve import WeightSender, WeightTransferError
from trainer_cli import bucket_report, control_client, print_refusal, trainer_arguments  # beside this script


def named_weights(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint's safetensors files, float32 (as ``from_pretrained(dtype=torch.float32)``)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    return [(name, tensor.float()) for path in files for name, tensor in load_file(path).items()]


async def main(args: argparse.Namespace) -> int:
    weights = named_weights(args.model)
    async with control_client(args.address) as client:
        sender = WeightSender(client, backend="gloo", bucket_bytes=args.bucket_bytes, on_bucket=bucket_report(args),
                              timeout=args.timeout)
        try:
            ack = await sender.send(weights, epoch=args.epoch)
        except (ControlError, WeightTransferError) as exc:
            print_refusal(exc)
            return 1
    print(json.dumps(ack), flush=True)
    return 0


if __name__ == "__main__":
    parser = trainer_arguments(timeout=120.0)
    parser.add_argument("bucket_bytes", type=int)
    raise SystemExit(asyncio.run(main(parser.parse_args())))
