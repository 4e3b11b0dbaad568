"""What the trainer scripts of the weight tests (``trainer.py``, ``sharded_trainer.py``) share: the start of their
command line, the line each bucket prints with the fault a test asks for there, the control client they send with,
and how a refused send is printed. The scripts import it from their folder (``sys.path[0]``, as a script run by
``python`` or by :func:`tests.forked.run_scripts` has it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from typing import Callable

from megatron_serve.client.coordinator_client import InferenceClient


def trainer_arguments(timeout: float) -> argparse.ArgumentParser:
    """``ADDRESS MODEL EPOCH`` (the script adds its own positionals after them), ``--timeout S`` (the transfer's,
    ``WeightSender``'s; default ``timeout``), ``--die-after-bucket N`` (SIGKILL right after bucket N left, like a
    crashed trainer) and ``--hold-after-bucket N`` (stop sending there, alive, until killed)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("model")
    parser.add_argument("epoch", type=int)
    parser.add_argument("--timeout", type=float, default=timeout)
    parser.add_argument("--die-after-bucket", type=int, default=None)
    parser.add_argument("--hold-after-bucket", type=int, default=None)
    return parser


def bucket_report(args: argparse.Namespace) -> Callable[[int, int, int], None]:
    """``WeightSender``'s ``on_bucket``: one line per bucket that left (``{"bucket", "of", "at"}``, ``at`` its
    ``time.time()``), then the fault ``args`` asks for at that bucket."""
    def on_bucket(index: int, count: int, nbytes: int) -> None:
        print(json.dumps({"bucket": index + 1, "of": count, "at": time.time()}), flush=True)
        if args.die_after_bucket is not None and index + 1 >= args.die_after_bucket:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.hold_after_bucket is not None and index + 1 >= args.hold_after_bucket:
            threading.Event().wait()

    return on_bucket


def control_client(address: str) -> InferenceClient:
    """A control client (the verbs and STATUS a trainer sends, without the tokenizer a client that submits loads),
    with the fleet secret in ``$MEGATRON_SERVE_TOKEN``."""
    return InferenceClient(address, token=os.environ.get("MEGATRON_SERVE_TOKEN"), role="control")


def print_refusal(exc: Exception) -> None:
    """A send that failed, as the scripts' last line: ``{"error", "type", "at"}`` (``at``: when, ``time.time()``)."""
    print(json.dumps({"error": str(exc), "type": type(exc).__name__, "at": time.time()}), flush=True)
