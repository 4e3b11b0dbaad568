"""A trainer process for the weight-sync tests: push a Hugging Face checkpoint's weights into a fleet.

``python trainer.py ADDRESS MODEL_DIR EPOCH BUCKET_BYTES [--die-after-bucket N]`` (the fleet secret in
``$MEGATRON_SERVE_TOKEN``) prints one JSON line (the acknowledgement, or the error) and exits 0 when the fleet acknowledged. With
``--die-after-bucket N`` it kills itself (SIGKILL, like a crashed trainer) right after bucket N left; with
``--hold-after-bucket N`` it stops sending there, alive, until killed (the moment a partition test cuts its link).
``--timeout S`` is the transfer's time-out (``WeightSender``'s).

The weights are the checkpoint's tensors as float32, by the names a ``transformers`` model's ``named_parameters()``
gives them (a tiny model's file holds exactly those): read straight from the file, since importing transformers
and building its model cost each trainer process ~4 s of CPU, more than the transfer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file

from megatron_serve.client.coordinator_client import ControlError, InferenceClient
from megatron_serve import WeightSender, WeightTransferError


def named_weights(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint's safetensors files, float32 (as ``from_pretrained(dtype=torch.float32)``)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    return [(name, tensor.float()) for path in files for name, tensor in load_file(path).items()]


async def main(args: argparse.Namespace) -> int:
    weights = named_weights(args.model)

    def on_bucket(index: int, count: int, nbytes: int) -> None:
        print(json.dumps({"bucket": index + 1, "of": count}), flush=True)
        if args.die_after_bucket is not None and index + 1 >= args.die_after_bucket:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.hold_after_bucket is not None and index + 1 >= args.hold_after_bucket:
            threading.Event().wait()

    # a control client: the verbs and STATUS a trainer sends, without the tokenizer a client that submits loads
    async with InferenceClient(args.address, token=os.environ.get("MEGATRON_SERVE_TOKEN"), role="control") as client:
        sender = WeightSender(client, backend="gloo", bucket_bytes=args.bucket_bytes, on_bucket=on_bucket,
                              timeout=args.timeout)
        try:
            ack = await sender.send(weights, epoch=args.epoch)
        except (ControlError, WeightTransferError) as exc:
            print(json.dumps({"error": str(exc)}), flush=True)
            return 1
    print(json.dumps(ack), flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("model")
    parser.add_argument("epoch", type=int)
    parser.add_argument("bucket_bytes", type=int)
    parser.add_argument("--die-after-bucket", type=int, default=None)
    parser.add_argument("--hold-after-bucket", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=120.0)
    raise SystemExit(asyncio.run(main(parser.parse_args())))
