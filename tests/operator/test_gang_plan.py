"""gang.plan, pure: which pods of a StatefulSet group to delete so that it restarts whole, and when its
start is recorded; a stale record never deletes a pod that a restart left alone."""

from __future__ import annotations

import pytest

from megatron_operator.config import ENV_LEADER_WORKER_SET, OperatorConfig
from megatron_operator.gang import RankPod, plan


def pod(rank: int, uid: str, restarts: int = 0, terminating: bool = False) -> RankPod:
    return RankPod(rank=rank, pod=f"moe-engine-0-{rank}", uid=uid, ready=True, restarts=restarts,
                   terminating=terminating, node_name=None)


def record(*members: tuple[int, str, int]) -> dict:
    return {"group": 0, "startedWith": [{"rank": r, "podUID": u, "restarts": n} for r, u, n in members]}


def test_first_complete_start_is_recorded_and_nothing_deleted():
    assert plan(None, [pod(0, "a"), pod(1, "b")], 2) == ([], [{"rank": 0, "podUID": "a", "restarts": 0},
                                                             {"rank": 1, "podUID": "b", "restarts": 0}])
    # incomplete (a rank missing or terminating): nothing recorded yet
    assert plan(None, [pod(0, "a")], 2) == ([], [])
    assert plan(None, [pod(0, "a"), pod(1, "b", terminating=True)], 2) == ([], [])


@pytest.mark.parametrize("worker", [pod(1, "b2"), pod(1, "b", restarts=1), pod(1, "b", terminating=True), None],
                         ids=["recreated", "container restarted", "terminating", "missing"])
def test_one_rank_restarted_deletes_the_others(worker):
    started = record((0, "a", 0), (1, "b", 0), (2, "c", 0))
    ranks = [pod(0, "a"), pod(2, "c")] + ([worker] if worker else [])
    doomed, kept = plan(started, ranks, 3)
    assert doomed == ["moe-engine-0-0", "moe-engine-0-2"]
    assert kept == started["startedWith"]  # the record waits for the new start


def test_a_whole_restart_is_recorded_and_deletes_nothing():
    started = record((0, "a", 0), (1, "b", 0))
    assert plan(started, [pod(0, "a2"), pod(1, "b", restarts=1)], 2) == (
        [], [{"rank": 0, "podUID": "a2", "restarts": 0}, {"rank": 1, "podUID": "b", "restarts": 1}])
    # an older record than that (a stale status) sees every pod restarted: still nothing deleted
    assert plan(record((0, "a0", 0), (1, "b", 0)), [pod(0, "a2"), pod(1, "b", restarts=1)], 2)[0] == []


def test_unchanged_group_and_single_pod_groups_are_left_alone():
    started = record((0, "a", 0), (1, "b", 0))
    assert plan(started, [pod(0, "a"), pod(1, "b")], 2) == ([], started["startedWith"])
    assert plan(record((0, "a", 0)), [pod(0, "a", restarts=3)], 1)[0] == []


def test_leader_worker_set_mode_from_the_environment():
    assert OperatorConfig.from_env({}).leader_worker_set is True
    assert OperatorConfig.from_env({ENV_LEADER_WORKER_SET: "never"}).leader_worker_set is False
    with pytest.raises(ValueError, match=ENV_LEADER_WORKER_SET):
        OperatorConfig.from_env({ENV_LEADER_WORKER_SET: "always"})
