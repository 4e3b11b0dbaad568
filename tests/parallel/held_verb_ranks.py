"""One data-parallel attention leader in a gloo group of leaders, turning its step loop as an engine process does
(``engine.process.loop.EngineProcess.run``): it gets its copy of a trainer's refit at the turn its command line names, holds
it, and prints the turn at which the leaders agreed to act on it (``test_data_parallel_attention``)."""

from __future__ import annotations

import datetime
import sys

import torch.distributed as dist

from megatron_serve.engine.group.data_parallel import agree_turn
from megatron_serve.engine.group.turns import HeldVerb


def main() -> None:
    rank, world, arrives = (int(arg) for arg in sys.argv[1:4])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    held = None
    for turn in range(10):  # past the last arrival (the test's)
        if turn == arrives:
            held = HeldVerb("REFIT", None, float("inf"))
        if agree_turn(dist.group.WORLD, busy=False, holding=held is not None).verb:
            print(turn, flush=True)
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
