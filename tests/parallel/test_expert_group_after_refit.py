"""After a refit, an expert-parallel group of data-parallel attention ranks cannot read a lost rank's experts back from
the checkpoint (they would be the checkpoint's, not the refit's): the survivors agree on it, all exit naming why,
and the group's restart (every rank, by hand here as ``run``'s gang does it) is sent the fleet's weights again by the
coordinator and completes every stream with the uninterrupted tokens. Without the refit the same loss leaves the
others serving (test_expert_group_resize: the control)."""

from __future__ import annotations

import pytest

from ..helpers import free_port, until
from .expert_group_stack import KILLED, RANKS, expert_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKENS = 32


async def test_a_loss_after_a_refit_ends_the_group_instead_of_mixing_checkpoint_experts_in(tmp_path):
    async with expert_group(tmp_path, TOKENS) as group:
        await group.client.pause()
        ack = await group.client.refit(group.model_dir)  # the same values, a new generation: the weights' epoch 1
        assert ack["detail"]["epoch"] == 1, ack
        await group.client.unpause()
        tasks = await group.in_flight()
        survivors = [engine for rank, engine in enumerate(group.engines) if rank != KILLED]
        group.engines[KILLED].kill()
        await until(lambda: all(engine.poll() is not None for engine in survivors), 120,
                    "the survivors' exits")  # each refuses to serve on with stale experts
        for engine in survivors:
            assert "a refit changed the weights since the start" in group.children.log_of(engine)

        group.rendezvous["MASTER_PORT"] = str(free_port())  # the gang's restart, at a fresh rendezvous
        group.engines = [group.engine(rank) for rank in range(RANKS)]
        await group.completed(tasks)  # resubmitted, on engines the coordinator refitted: the uninterrupted tokens
        epochs = {engine["epoch"] for engine in (await group.client.status())["engines"]}
        assert epochs == {1}, epochs
