"""Data-parallel attention leaders in a gloo group, each turning its step loop as an engine process does
(``engine.process.loop.EngineProcess.run``): each gets its copy of a trainer's refit at the turn its command line
names, holds it, and prints the turn at which the leaders agreed to act on it (``test_data_parallel_attention``)."""

from __future__ import annotations

import datetime
import sys

import torch.distributed as dist

from megatron_serve.engine.group.data_parallel import agree_turn
from megatron_serve.engine.group.turns import HeldVerb

from forked_ranks import fork_ranks, report  # beside this script (its folder: sys.path[0])


def main() -> None:
    """``held_verb_ranks.py TURN...``: one leader per arrival turn, each a child forked from this process once it has
    imported what they run (a process's start, importing torch, costs more than the leaders' turns); prints each
    leader's ``rank|turn`` (:func:`forked_ranks.report`), and exits non-zero where a leader did."""
    arrivals = [int(arg) for arg in sys.argv[1:]]
    sys.exit(fork_ranks(lead, [(rank, len(arrivals), arrives) for rank, arrives in enumerate(arrivals)]))


def lead(rank: int, world: int, arrives: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    held = None
    for turn in range(10):  # past the last arrival (the test's)
        if turn == arrives:
            held = HeldVerb("REFIT", None, float("inf"))
        if agree_turn(dist.group.WORLD, busy=False, holding=held is not None).verb:
            report(rank, turn)
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
