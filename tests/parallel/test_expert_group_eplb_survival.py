"""A rank's loss without a restart under EPLB (engine.group.survival with ``--enable-eplb``): a tiny Qwen3-MoE whose
router favours two experts, over four engine processes over gloo (one data-parallel rank each), 4 redundant experts
and a plan every 8 steps, so the experts have moved before the kill. One rank SIGKILLed mid-stream: the three others
serve on in their own processes (the balancer's move under way dropped, the placement recovered over them from what
each holds and the checkpoint, the balancer restarted over the new group), every stream ends with the tokens of the
uninterrupted run, and the experts move again over the three, with the tokens still ``==``
(``--batch-invariant``: a token's result depends neither on the rank count nor on which replica ran it). The lost
rank's restart then joins (the membership's placement, EPLB's copies included), and the four serve and balance again,
the tokens still ``==``. And a rank killed with a move in flight (a router without a favourite and a plan every step,
so the layers move all the time): the move is dropped, the three serve on, every stream ``==``."""

from __future__ import annotations

import asyncio
import json
import re
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest

from tests.run_stack import client_stream

from .expert_group_stack import KILLED, PROMPTS, RANKS, ExpertGroup, expert_group
from .test_expert_parallel_eplb import skewed_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKENS = 32
#: a plan every 8 steps from the last 8: the experts move during the uninterrupted run, and again over the three left
EPLB = {"window_size": 8, "step_interval": 8, "num_redundant_experts": 4}
#: a plan every step from the last one: under a router without favourites the layers move nearly every step
RESTLESS = {"window_size": 1, "step_interval": 1, "num_redundant_experts": 4}
PLANNED = re.compile(r"EPLB at step \d+: .*; (\d+) of \d+ MoE layers to move")


def balanced_group(tmp_path: Path, model_dir: str | None, eplb: dict) -> AbstractAsyncContextManager[ExpertGroup]:
    """The stack over ``model_dir`` (the tiny Qwen3-MoE where None) with EPLB on (``eplb``: its ``--eplb-config``)."""
    return expert_group(tmp_path, TOKENS, model_dir, ("--enable-eplb", "--eplb-config", json.dumps(eplb)))


async def test_a_killed_rank_leaves_the_others_balancing_and_serving(tmp_path):
    async with balanced_group(tmp_path, skewed_model(tmp_path / "m", "qwen3_moe"), EPLB) as group:
        leader = group.engines[0]
        assert f"moved over {RANKS} ranks" in group.children.log_of(leader), "no expert moved before the kill"
        await group.kill_mid_stream(KILLED)
        again = await asyncio.gather(*(client_stream(group.client, p, TOKENS) for p in PROMPTS))
        assert [a.tokens for a in again] == [q.tokens for q in group.quiet], [a.error for a in again]
        after = group.children.log_of(leader).split(f"is rank 0 of the {RANKS - 1} left", 1)
        assert len(after) == 2 and f"moved over {RANKS - 1} ranks" in after[1], after[-1][-3000:]

        await group.rejoin(KILLED)  # the lost rank's restart joins: the membership's placement, EPLB over four
        after = group.children.log_of(leader).split(f"is rank 0 of {RANKS} in generation", 1)
        assert len(after) == 2 and f"moved over {RANKS} ranks" in after[1], after[-1][-3000:]


async def test_a_rank_killed_with_a_move_in_flight_leaves_the_others_serving(tmp_path):
    async with balanced_group(tmp_path, None, RESTLESS) as group:
        leader = group.engines[0]
        tasks = await group.in_flight()
        plans = len(PLANNED.findall(group.children.log_of(leader)))
        while not (found := PLANNED.findall(group.children.log_of(leader)))[plans:] or found[-1] == "0":
            await asyncio.sleep(0.002)  # the kill follows a plan that moves layers: one a step, from the next step
        group.engines[KILLED].kill()
        await group.completed(tasks)
        before = group.children.log_of(leader).split("a collective failed", 1)[0]
        moved = before.rsplit("layers to move", 1)[1].count(f"moved over {RANKS} ranks")
        assert moved < int(found[-1]), f"the planned moves were done before the kill: {before[-2000:]}"
        again = await asyncio.gather(*(client_stream(group.client, p, TOKENS) for p in PROMPTS))
        assert [a.tokens for a in again] == [q.tokens for q in group.quiet], [a.error for a in again]
        assert all(engine.poll() is None for d, engine in enumerate(group.engines) if d != KILLED)
