"""``megatron-serve rendezvous-store --host H --port P``: an elastic expert group's rendezvous store, in a process of
its own, served until the process is ended (SIGTERM, SIGINT or SIGKILL).

The ranks of a group meet in a torch ``TCPStore``; without this process, data-parallel rank 0's engine hosts it, and
that engine's loss takes the store with it (the group can no longer regroup: it exits and restarts as a whole). An
elastic group whose engines are told the store is hosted elsewhere (``TORCHELASTIC_USE_AGENT_STORE=True``, torchrun's
convention, with ``MASTER_ADDR``/``MASTER_PORT`` naming this process) survives the loss of any rank, rank 0 included,
and a lost rank's restart joins (``engine/group/membership.py``). ``run`` starts one per elastic group. It holds
nothing secret beyond what the store held in rank 0's process and binds where that one did (``--host``).
"""

from __future__ import annotations

import argparse
import signal

from .flags import add_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "rendezvous_store")


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port < 65536:  # refused before torch's import (seconds of CPU), not after it
        raise SystemExit(f"rendezvous-store: --port {args.port} is not a TCP port (0 to 65535)")
    import datetime  # noqa: PLC0415 - torch only once the command runs (cli.py)

    import torch.distributed as dist  # noqa: PLC0415

    from ..engine.group.placement import RENDEZVOUS_TIMEOUT_S  # noqa: PLC0415

    ending = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, ending)  # before the store's threads start: they inherit the mask
    store = dist.TCPStore(args.host, args.port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    print(f"rendezvous store serving at {args.host}:{store.port}", flush=True)
    signal.sigwait(ending)
    del store
    return 0
