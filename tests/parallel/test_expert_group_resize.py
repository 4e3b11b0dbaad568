"""Resizing an expert-parallel group of data-parallel attention ranks without a restart (engine.group.membership),
over a tiny Qwen3-MoE on four engine processes over gloo, one rank each, under ``--batch-invariant`` (a token's
result depends neither on the rank count nor on where its experts run, so every stream must have the tokens of an
uninterrupted run):

* one rank SIGKILLed mid-stream, the three others serve on in their own processes (regrouped over the ranks left,
  resumed from one step boundary, the lost rank's experts read back from the checkpoint, its requests resubmitted by
  the coordinator) and serve new requests after it; then the lost rank's restart joins the running group: the
  members take it in at a turn they agree on, the four form the next generation's group, the experts go back to
  their placement by index, and each of the four serves; then another rank SIGKILLed mid-stream, and the three left,
  the joiner among them, serve on;
* ``scale_ep 3`` mid-stream: the highest rank hands its requests back and exits, the three others regroup without
  it and every stream completes; its restart then joins, and the four serve again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.run_stack import client_stream

from .expert_group_stack import KILLED, PROMPTS, RANKS, ExpertGroup, expert_group

# One stack for the module: the scale test leaves its four ranks serving, and the loss test, which ends one for good,
# comes after it (a stack's start, four engine processes importing torch, was half of each test's CPU).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.asyncio(loop_scope="module")]

TOKENS = 20


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def group(tmp_path_factory) -> AsyncIterator[ExpertGroup]:
    async with expert_group(tmp_path_factory.mktemp("resize"), TOKENS) as group:
        yield group


async def test_scale_ep_shrinks_the_group_mid_stream_and_its_restart_joins_again(group):
    tasks = await group.in_flight()
    ack = await group.client.scale_ep(RANKS - 1)
    assert ack["detail"]["wanted"] == RANKS - 1 and len(ack["detail"]["leaving"]) == 1, ack
    await group.completed(tasks)
    left = group.engines[RANKS - 1]
    assert left.wait(timeout=60) == 0, group.children.log_of(left)[-3000:]
    for rank in range(RANKS - 1):
        await group.logged(group.engines[rank], f"expert-parallel rank {rank} is rank {rank} of {RANKS - 1}", 30)
    served = await group.served_by_each()
    assert len(served) == RANKS - 1 and all(served.values()), served

    group.engines[RANKS - 1] = await group.rejoin(RANKS - 1)  # scale back up: the rank's engine started again joins


async def test_the_lost_rank_restarted_joins_the_running_group_and_serves(group):
    survivors = await group.kill_mid_stream(KILLED)
    again = await asyncio.gather(*(client_stream(group.client, p, TOKENS) for p in PROMPTS[:3]))
    assert [a.tokens for a in again] == [q.tokens for q in group.quiet[:3]]  # the three serve on

    said = [len(group.children.log_of(survivor)) for survivor in survivors]  # the scale test's joins do not count
    joiner = await group.rejoin(KILLED)  # every rank serves, the joiner among them
    for rank, survivor, since in zip([r for r in range(RANKS) if r != KILLED], survivors, said):
        await group.logged(survivor, f"expert-parallel rank {rank} is rank {rank} of {RANKS}", 30, since)
    assert all(engine.poll() is None for engine in survivors)
    group.engines[KILLED] = joiner
    await group.kill_mid_stream(1)  # a loss after the join: the three left, the joiner among them, serve on
