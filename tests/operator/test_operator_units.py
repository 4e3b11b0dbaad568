"""Pure pieces of the operator: lifecycle planning, status computation, child diffs, config,
the engine probe, and `megatron-serve operator` started as a process against the emulator."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import pytest

from .helpers import NS, ROOT, load_yaml, wait_for

from megatron_operator import coordinator_link, lifecycle, probe, reconcile, status
from megatron_operator.config import OperatorConfig


@pytest.mark.parametrize("current,target,verbs", [
    ("RUNNING", "RUNNING", []),
    ("RUNNING", "PAUSED", ["pause"]),
    ("RUNNING", "SUSPENDED", ["pause", "suspend"]),
    ("SUSPENDED", "RUNNING", ["resume", "unpause"]),
    ("SUSPENDED", "PAUSED", ["resume"]),
    ("PAUSED", "RUNNING", ["unpause"]),
    ("PAUSED", "STOPPED", ["stop"]),
    ("SUSPENDED", "STOPPED", ["stop"]),
    ("STOPPED", "RUNNING", ["unpause"]),
    ("STOPPED", "SUSPENDED", ["unpause", "pause", "suspend"]),
])
def test_lifecycle_plan(current, target, verbs):
    assert lifecycle.plan(current, target) == verbs
    state = current
    for verb in verbs:
        state = lifecycle.next_state(state, verb)
    assert state == target


def test_lifecycle_names():
    assert [lifecycle.target_state(x) for x in ("Running", "Paused", "Suspended", "Shutdown")] == \
        ["RUNNING", "PAUSED", "SUSPENDED", "STOPPED"]
    assert lifecycle.lifecycle_of("stopped") == "Shutdown" and lifecycle.lifecycle_of(None) is None
    with pytest.raises(ValueError, match="unknown lifecycle"):
        lifecycle.target_state("Sleeping")
    # RESUME where memory is resident is a no-op (megatron_serve.wire.lifecycle), UNPAUSE while SUSPENDED is refused
    assert lifecycle.next_state("RUNNING", "resume") == "RUNNING"
    with pytest.raises(ValueError, match="RESUME first"):
        lifecycle.next_state("SUSPENDED", "unpause")


def obs(**kwargs: Any) -> status.Observation:
    base = dict(generation=1, desired_lifecycle="Running", coordinator_ok=True, observed_lifecycle="Running",
                engines_desired=2, engines_ready=2, engines_connected=2, endpoint="http://x", selector="s")
    return status.Observation(**{**base, **kwargs})


def test_status_phases_and_stable_timestamps():
    ready = status.compute(None, obs(), now="2026-01-01T00:00:00Z")
    assert ready["phase"] == "Ready" and ready["observedGeneration"] == 1
    assert {c["type"]: c["status"] for c in ready["conditions"]} == dict.fromkeys(
        ["Ready", "CoordinatorReady", "EnginesReady", "LifecycleSynced", "Progressing", "SpecValid"], "True")
    # nothing new: the same status, nothing to write
    again = status.compute(ready, obs(), now="2026-01-01T00:01:00Z")
    assert status.changes(ready, again) == {}
    # a group goes missing: Degraded, and only that condition's time moves
    degraded = status.compute(ready, obs(engines_ready=1), now="2026-01-01T00:02:00Z")
    assert degraded["phase"] == "Degraded"
    times = {c["type"]: c["lastTransitionTime"] for c in degraded["conditions"]}
    assert times["EnginesReady"] == times["Ready"] == "2026-01-01T00:02:00Z"
    assert times["CoordinatorReady"] == "2026-01-01T00:00:00Z"
    # a new generation in progress is Progressing, not Degraded
    assert status.compute(ready, obs(generation=2, engines_ready=1))["phase"] == "Progressing"
    # first contact: Pending until something answers
    assert status.compute(None, obs(coordinator_ok=False, observed_lifecycle=None, engines_ready=0,
                                    engines_connected=0))["phase"] == "Pending"
    paused = status.compute(ready, obs(desired_lifecycle="Paused", observed_lifecycle="Paused"),
                            now="2026-01-01T00:03:00Z")
    assert paused["phase"] == "Paused" and paused["lifecycle"]["since"] == "2026-01-01T00:03:00Z"
    assert ready["lifecycle"]["since"] == "2026-01-01T00:00:00Z"
    # spec.lifecycle changed (a new generation), the coordinator still RUNNING
    unsynced = status.compute(ready, obs(generation=2, desired_lifecycle="Paused"))
    assert unsynced["phase"] == "Progressing"
    assert {c["type"]: c["status"] for c in unsynced["conditions"]}["LifecycleSynced"] == "False"
    shutdown = status.compute(ready, obs(desired_lifecycle="Shutdown", observed_lifecycle="Shutdown",
                                         engines_desired=0, engines_ready=0, engines_connected=0))
    assert shutdown["phase"] == "Shutdown"


def _pod(name: str, phase: str, scheduled: dict[str, str] | None) -> dict[str, Any]:
    conditions = [] if scheduled is None else [{"type": "PodScheduled", **scheduled}]
    return {"metadata": {"name": name}, "status": {"phase": phase, "conditions": conditions}}


def test_unschedulable_engine_pods_say_why_in_engines_ready():
    """The scheduler's reason on Pending pods reaches the EnginesReady condition; placed pods, and pods the
    scheduler has not tried yet, say nothing."""
    from megatron_operator.scheduling import unschedulable

    why = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    stuck = {"status": "False", "reason": "Unschedulable", "message": why}
    assert unschedulable([_pod("a-0", "Running", {"status": "True"}), _pod("a-1", "Pending", None)]) == ""
    assert unschedulable([_pod("a-1", "Pending", stuck), _pod("a-0", "Running", {"status": "True"})]) == \
        f"pod a-1 cannot be scheduled: {why}"
    many = unschedulable([_pod(f"a-{i}", "Pending", stuck) for i in range(5)])
    assert many.startswith("pods a-0, a-1, a-2 and 2 more cannot be scheduled: ")
    waiting = status.compute(None, obs(engines_ready=0, engines_unschedulable=f"pod a-1 cannot be scheduled: {why}"))
    cond = next(c for c in waiting["conditions"] if c["type"] == "EnginesReady")
    assert cond["reason"] == "Unschedulable" and why in cond["message"] and cond["message"].startswith("0/2 engine")
    ready = status.compute(None, obs(engines_unschedulable="stale"))  # every group ready: no reason to give
    assert next(c for c in ready["conditions"] if c["type"] == "EnginesReady")["reason"] == "AllReady"


def test_status_for_an_invalid_spec_keeps_what_was_known():
    ready = status.compute(None, obs(), now="2026-01-01T00:00:00Z")
    failed = status.compute(ready, status.Observation(generation=2, spec_error="spec.x: bad"))
    assert failed["phase"] == "Failed" and failed["observedGeneration"] == 2
    conds = {c["type"]: c for c in failed["conditions"]}
    assert conds["SpecValid"]["status"] == "False" and conds["SpecValid"]["message"] == "spec.x: bad"
    assert conds["CoordinatorReady"] == next(c for c in ready["conditions"] if c["type"] == "CoordinatorReady")
    assert failed["engines"] == ready["engines"]


def test_child_diff_ignores_server_defaults():
    want = {"spec": {"replicas": 1, "template": {"spec": {"containers": [{"name": "a", "image": "x",
                                                                          "resources": {"limits": {"gpu": 2}}}]}}}}
    live = {"spec": {"replicas": 1, "revisionHistoryLimit": 10, "template": {"spec": {
        "dnsPolicy": "ClusterFirst",
        "containers": [{"name": "a", "image": "x", "imagePullPolicy": "IfNotPresent",
                        "resources": {"limits": {"gpu": "2"}}}]}}}}
    assert reconcile.contains(want, live) and reconcile.diff(want, live) == {}
    changed = {"spec": {"replicas": 2, "template": want["spec"]["template"]}}
    assert reconcile.diff(changed, live) == {"spec": {"replicas": 2}}
    two = {"spec": {"template": {"spec": {"containers": [{"name": "a"}, {"name": "b"}]}}}}
    assert reconcile.diff(two, live) == {"spec": {"template": {"spec": {"containers": [{"name": "a"}, {"name": "b"}]}}}}


def test_settled_and_group_ready():
    sts = {"metadata": {"generation": 3}, "spec": {"replicas": 2},
           "status": {"observedGeneration": 3, "readyReplicas": 2, "updatedReplicas": 2}}
    assert reconcile.settled(sts) and reconcile.group_ready(sts, 2)
    assert not reconcile.group_ready(sts, 3)
    assert not reconcile.settled({**sts, "status": {**sts["status"], "observedGeneration": 2}})
    assert not reconcile.group_ready(None, 1)


def test_config_from_env():
    cfg = OperatorConfig.from_env({"MEGATRON_OPERATOR_COORDINATOR_ADDRESS": "tcp://127.0.0.1:7000",
                                   "MEGATRON_OPERATOR_RECONCILE_INTERVAL": "2.5",
                                   "MEGATRON_OPERATOR_POD_LABELS": "a=b, c=d",
                                   "MEGATRON_OPERATOR_TOKEN_KEY": "k", "MEGATRON_OPERATOR_SCANNING": "false",
                                   "MEGATRON_OPERATOR_PEERING_LIFETIME": "10"})
    assert cfg.coordinator_address("n", "ns") == "tcp://127.0.0.1:7000"
    assert cfg.reconcile_interval == 2.5 and cfg.operator_pod_labels == {"a": "b", "c": "d"}
    assert cfg.token_key == b"k" and cfg.scanning is False and cfg.peering_lifetime == 10
    default = OperatorConfig.from_env({})
    assert default.coordinator_address("llm", "ml") == "tcp://llm-coordinator.ml.svc:5555"
    assert OperatorConfig.from_env({}).token_key != default.token_key  # random per operator process
    assert OperatorConfig().token_key != OperatorConfig().token_key  # no well-known default either
    with pytest.raises(ValueError, match="MEGATRON_OPERATOR_RECONCILE_INTERVAL"):
        OperatorConfig.from_env({"MEGATRON_OPERATOR_RECONCILE_INTERVAL": "soon"})
    with pytest.raises(ValueError, match="MEGATRON_OPERATOR_COORDINATOR_ADDRESS"):
        OperatorConfig.from_env({"MEGATRON_OPERATOR_COORDINATOR_ADDRESS": "tcp://{host}:1"})
    with pytest.raises(ValueError, match="MEGATRON_OPERATOR_PEERING_LIFETIME: must be positive"):
        OperatorConfig.from_env({"MEGATRON_OPERATOR_PEERING_LIFETIME": "0"})


def test_peering_priority_is_an_integer_or_ranks_by_start(monkeypatch: pytest.MonkeyPatch):
    from megatron_operator import config

    assert OperatorConfig.from_env({}).peering_priority is None  # kopf's --priority then
    assert OperatorConfig.from_env({"MEGATRON_OPERATOR_PEERING_PRIORITY": "-5"}).peering_priority == -5
    ranks = []
    for started in (1_700_000_000_000_000_000, 1_700_000_000_000_001_000):  # a replica, then one a microsecond later
        monkeypatch.setattr(config.time, "time_ns", lambda: started)
        ranks.append(OperatorConfig.from_env({"MEGATRON_OPERATOR_PEERING_PRIORITY": "oldest-first"}).peering_priority)
    assert ranks[0] - 1 == ranks[1] > 0  # the older outranks the newer
    with pytest.raises(ValueError, match="MEGATRON_OPERATOR_PEERING_PRIORITY: expected an integer or oldest-first"):
        OperatorConfig.from_env({"MEGATRON_OPERATOR_PEERING_PRIORITY": "first"})


@pytest.mark.parametrize("arg", ["--priority=5", "--priority", "-p5", "-p", "--dev"])
def test_operator_refuses_a_priority_option_beside_the_variable(arg: str, tmp_path):
    """``megatron-serve operator --priority N`` with ``$MEGATRON_OPERATOR_PEERING_PRIORITY`` set: the variable, applied
    at startup, would silently replace the option; the operator refuses to start, naming both. The control: the
    option alone is kopf's to parse."""
    from megatron_operator import cli

    env = {**os.environ, "MEGATRON_OPERATOR_PEERING_PRIORITY": "oldest-first",
           "KUBECONFIG": str(tmp_path / "absent")}  # never reached: the refusal comes before kopf logs in
    done = subprocess.run([sys.executable, "-m", "megatron_operator", "operator", "--peering=p", arg, "5"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1
    assert f"{arg} and $MEGATRON_OPERATOR_PEERING_PRIORITY both set kopf's peering priority" in done.stderr
    cli.refuse_two_priorities(["--peering=p", arg], {})
    cli.refuse_two_priorities(["--peering=p", "--log-prefix"], {"MEGATRON_OPERATOR_PEERING_PRIORITY": "3"})


class _Link:
    def __init__(self, reply: dict[str, Any]):
        self.reply = reply
        self.address = "tcp://x:1"

    async def status(self, timeout: float) -> dict[str, Any]:
        return self.reply

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("mode,reply,up,rc", [
    ("registered", {"state": "RUNNING", "engines": [{"group": 3}]}, True, 0),
    ("registered", {"state": "RUNNING", "engines": [{"group": 1}]}, True, 1),
    ("registered", None, False, 1),
    ("alive", None, False, 0),  # an unreachable coordinator is no reason to restart engines
    ("alive", {"state": "RUNNING", "engines": []}, True, 1),
    ("alive", {"state": "STOPPED", "engines": []}, True, 0),
])
def test_engine_probe(mode, reply, up, rc, monkeypatch: pytest.MonkeyPatch):
    async def factory(address: str, token: str | None, timeout: float):
        if not up:
            raise coordinator_link.CoordinatorUnavailable("connection refused")
        assert token == "t"
        return _Link(reply)

    coordinator_link.set_link_factory(factory)
    try:
        monkeypatch.setenv("MEGATRON_SERVE_COORDINATOR", "tcp://x:1")
        monkeypatch.setenv("MEGATRON_SERVE_GROUP", "3")
        monkeypatch.setenv("MEGATRON_SERVE_TOKEN", "t")
        assert probe.main([mode]) == rc
    finally:
        coordinator_link.set_link_factory(None)
    assert probe.main(["bogus"]) == 2


async def test_operator_command_runs_kopf_against_the_cluster(cluster):
    """`python -m megatron_operator operator --standalone` (what `megatron-serve operator` runs)."""
    await cluster.install_crd()
    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "single-gpu.yaml")
    resource["metadata"]["namespace"] = NS
    await cluster.apply(resource)
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "MEGATRON_OPERATOR_RECONCILE_INTERVAL": "1",
           "MEGATRON_OPERATOR_COORDINATOR_ADDRESS": "tcp://127.0.0.1:9",  # nothing listens there
           "MEGATRON_OPERATOR_CONNECT_TIMEOUT": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "megatron_operator", "operator", "--standalone", "--quiet",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        st = await wait_for(lambda: (s := cluster.status(NS, "llama-1b")).get("conditions") and s,
                            timeout=60, what="status from the operator process")
        conds = {c["type"]: c for c in st["conditions"]}
        assert conds["SpecValid"]["status"] == "True"
        assert conds["CoordinatorReady"]["status"] == "False"
        assert "tcp://127.0.0.1:9" in conds["CoordinatorReady"]["message"]
        assert ("Deployment", "llama-1b-coordinator") in cluster.children(NS, "llama-1b")
        # served cluster-wide by default: the resource was listed without a namespace
        assert ("list", "serving.megatron.dev", "megatroninferences", None) in cluster.emu.api_calls
    finally:
        proc.terminate()
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode in (0, -15), out.decode()[-6000:]


# --------------------------------------------------------------------------- the walk and the refit policy, no kopf

def _fake_link():
    from .helpers import FakeCoordinator

    coordinator = FakeCoordinator(groups=lambda: [0, 1], token=lambda: "t")
    return coordinator, asyncio.run(coordinator.open("tcp://c:5555", "t", 1.0))


def test_walk_sends_one_acknowledged_verb_per_state_and_stops_at_a_failure():
    from megatron_operator.lifecycle_walk import walk

    coordinator, link = _fake_link()
    done = asyncio.run(walk(link, "RUNNING", "SUSPENDED", command_timeout=5.0, drain_timeout=1.0))
    assert coordinator.commands == ["pause", "suspend"] and done.state == "SUSPENDED" and not done.error
    assert [e[2].split(" ({")[0] for e in done.events] == ["PAUSE (keep) acknowledged: RUNNING -> PAUSED",
                                                          "SUSPEND acknowledged: PAUSED -> SUSPENDED"]
    assert (coordinator.pause_modes, coordinator.pause_drains) == (["keep"], [None])
    waited = asyncio.run(walk(link, "SUSPENDED", "RUNNING", command_timeout=5.0, drain_timeout=1.0))
    assert not waited.error
    asyncio.run(walk(link, "RUNNING", "PAUSED", command_timeout=5.0, drain_timeout=7.0, pause_mode="wait"))
    assert (coordinator.pause_modes[-1], coordinator.pause_drains[-1]) == ("wait", 7.0)  # wait gets the drain time
    coordinator.state = "RUNNING"
    coordinator.state = "STOPPED"  # stopped meanwhile (the walk goes by the state it was given): RESUME is refused
    refused = asyncio.run(walk(link, "SUSPENDED", "RUNNING", command_timeout=5.0, drain_timeout=1.0))
    assert refused.error and not refused.link_lost and refused.state == "SUSPENDED"
    assert refused.events[-1][:2] == ("Warning", "LifecycleRejected")
    coordinator.up = False
    lost = asyncio.run(walk(link, "PAUSED", "RUNNING", command_timeout=5.0, drain_timeout=1.0))
    assert lost.error and lost.link_lost and lost.state == "PAUSED"


def _spec(path: str):
    from megatron_operator.spec import parse

    (resource,) = load_yaml(ROOT / "manifests" / "examples" / "single-gpu.yaml")
    resource["metadata"] = {"name": "m", "namespace": NS}
    resource["spec"]["model"]["path"] = path
    return parse(resource)


def test_refit_policy_refits_a_serving_fleet_in_place_and_rolls_pods_when_the_weights_are_refused():
    from megatron_operator.refit_policy import recorded_model, sync_weights

    coordinator, link = _fake_link()
    old = recorded_model({}, _spec("/models/a"), None)
    assert old == {"path": "/models/a", "epoch": 0, "templatePath": "/models/a"}
    status_reply = asyncio.run(link.status(1.0))
    done = asyncio.run(sync_weights(link, _spec("/models/b"), old, "RUNNING", status_reply, "RUNNING", 5.0))
    assert coordinator.commands == ["pause", "refit", "unpause"] and coordinator.state == "RUNNING"
    assert done.model["path"] == "/models/b" and done.model["epoch"] == 1 and done.model["templatePath"] == "/models/a"
    assert done.events[0][1] == "Refitted"
    coordinator.incompatible.add("/models/c")
    refused = asyncio.run(sync_weights(link, _spec("/models/c"), done.model, "RUNNING", asyncio.run(link.status(1.0)),
                                       "RUNNING", 5.0))
    assert refused.model == {"path": "/models/c", "epoch": 0, "templatePath": "/models/c"}  # the pods roll
    assert coordinator.state == "RUNNING" and refused.events[0][1] == "RefitFailed"
    # nothing serving (no link): nothing decided until the coordinator answers
    assert asyncio.run(sync_weights(None, _spec("/models/d"), done.model, None, None, "RUNNING", 5.0)).model == \
        done.model
