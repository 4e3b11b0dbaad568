"""A tiny Qwen3-MoE over expert parallelism 4 with data-parallel attention (four engine processes over gloo, one
rank each): one is SIGKILLed mid-stream, and the three others serve on in their own processes: they regroup over the
ranks left, agree where each stopped and resume from one step boundary (engine.group.regroup), the lost rank's
experts (placed by index) are read back from the checkpoint onto them, the coordinator resubmits the killed engine's
requests as it does for any lost engine, and every stream completes with the tokens of an uninterrupted run
(``--batch-invariant``: a token's result depends neither on the rank count nor on where its experts run)."""

from __future__ import annotations

import asyncio

import pytest

from tests.run_stack import client_stream

from .expert_group_stack import KILLED, PROMPTS, expert_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKENS = 48


async def test_a_killed_rank_leaves_the_others_serving_in_their_own_processes(tmp_path):
    async with expert_group(tmp_path, TOKENS) as group:
        await group.kill_mid_stream(KILLED)
        again = await asyncio.gather(*(client_stream(group.client, p, TOKENS) for p in PROMPTS[:3]))
        assert [a.tokens for a in again] == [q.tokens for q in group.quiet[:3]]  # the three serve on
