"""An expert-parallel group of two data-parallel attention ranks (one engine process each, gloo): rank 1 SIGKILLed
mid-stream, rank 0 serves on alone in its own process, holding every expert (its own kept, the lost rank's read back
from the checkpoint), and every stream completes with the uninterrupted tokens (``--batch-invariant``); rank 1's
restart then joins and the two serve again. (Rank 0 hosts the rendezvous store: its loss still ends the group.)"""

from __future__ import annotations

import pytest

from .expert_group_stack import expert_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKENS = 32


async def test_the_rank_left_alone_serves_on_and_the_lost_ones_restart_joins_it(tmp_path):
    async with expert_group(tmp_path, TOKENS, ranks=2) as group:
        [alone] = await group.kill_mid_stream(1)
        await group.logged(alone, "expert-parallel rank 0 is rank 0 of the 1 left", 30)
        served = await group.served_by_each()
        assert list(served.values()) == [len(group.quiet)], served  # rank 0 alone served them all

        await group.rejoin(1)
        assert alone.poll() is None
