"""kopf against the strict KMock emulator: children, status, idempotence, scaling, lifecycle,
invalid specs, rolling updates, restarts and the finalizer (fake coordinator in-process)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from .helpers import ROOT, fake_coordinator_for, load_yaml, posted, wait_for, with_uid

pytestmark = pytest.mark.timeout(120)

NS = "default"


def base_resource(name: str = "demo", data: int = 2) -> dict[str, Any]:
    (doc,) = load_yaml(ROOT / "manifests" / "examples" / "tp2-dp4.yaml")
    doc = copy.deepcopy(doc)
    doc["metadata"] = {"name": name, "namespace": NS}
    doc["spec"]["parallelism"]["data"] = data
    return doc


def rendered(resource: dict[str, Any], live: dict[str, Any], **kwargs: Any) -> list[dict[str, Any]]:
    from megatron_operator.config import OperatorConfig
    from megatron_operator.render import render

    return render(with_uid(resource, live), OperatorConfig.from_env(), **kwargs)


def conditions(status: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in status.get("conditions", [])}


async def test_apply_creates_rendered_children_and_status(cluster):
    from megatron_operator.reconcile import contains

    await cluster.install_crd()
    cluster.start_controllers()
    resource = base_resource()
    live = await cluster.apply(copy.deepcopy(resource))
    fake = fake_coordinator_for(cluster, NS, "demo")
    await cluster.start_operator(fake)

    st = await wait_for(lambda: cluster.status(NS, "demo").get("phase") == "Ready" and cluster.status(NS, "demo"),
                        what="phase Ready")
    expected = rendered(resource, live)
    children = cluster.children(NS, "demo")
    assert sorted(children) == sorted((o["kind"], o["metadata"]["name"]) for o in expected)
    for obj in expected:
        assert contains(obj, children[(obj["kind"], obj["metadata"]["name"])]), obj["metadata"]["name"]
    assert st["endpoint"] == "http://demo.default.svc:8000/v1"
    assert st["engines"] == {"desired": 2, "ready": 2, "connected": 2}
    assert st["lifecycle"]["desired"] == st["lifecycle"]["observed"] == "Running"
    assert st["observedGeneration"] == cluster.mi(NS, "demo")["metadata"]["generation"]
    assert set(conditions(st).values()) == {"True"}

    # A second (and third...) reconcile changes nothing: no API writes other than Events.
    passes = lambda: sum(1 for call in cluster.emu.api_calls  # noqa: E731
                         if call[0] == "get" and call[2] == "secrets")
    before_rv, before_passes = cluster.emu.rv, passes()
    await wait_for(lambda: passes() >= before_passes + 6, what="three more reconcile passes")
    changes = [m for m in cluster.emu.mutations_since(before_rv) if m[2] != "events"]
    assert changes == []


async def start(cluster, name: str = "demo", data: int = 2, **spec: Any):
    await cluster.install_crd()
    cluster.start_controllers()
    resource = base_resource(name, data)
    resource["spec"].update(spec)
    live = await cluster.apply(copy.deepcopy(resource))
    fake = fake_coordinator_for(cluster, NS, name)
    await cluster.start_operator(fake)
    await wait_for(lambda: cluster.status(NS, name).get("phase") in ("Ready", "Paused", "Suspended", "Shutdown"),
                   what="a steady phase")
    return resource, live, fake


def engine_names(cluster, name: str = "demo") -> list[str]:
    return sorted(k[1] for k in cluster.children(NS, name) if k[0] == "StatefulSet")


async def test_scaling_data_adds_and_removes_groups(cluster):
    await start(cluster, data=2)
    await cluster.patch_mi(NS, "demo", {"spec": {"parallelism": {"data": 3}}})
    await wait_for(lambda: engine_names(cluster) == ["demo-engine-0", "demo-engine-1", "demo-engine-2"],
                   what="a third engine group")
    await wait_for(lambda: cluster.status(NS, "demo")["engines"] == {"desired": 3, "ready": 3, "connected": 3},
                   what="three groups ready")
    assert ("Service", "demo-engine-2") in cluster.children(NS, "demo")

    # the scale subresource maps to spec.parallelism.data (kubectl scale / HPA)
    scale = await cluster.must("PATCH", cluster.mi_path(NS, "demo", "scale"), {"spec": {"replicas": 1}},
                               "application/merge-patch+json")
    assert scale["spec"]["replicas"] == 1
    await wait_for(lambda: sorted(k for k in cluster.children(NS, "demo") if "-engine-" in k[1])
                   == [("Service", "demo-engine-0"), ("StatefulSet", "demo-engine-0")], what="groups 1 and 2 removed")
    st = await wait_for(lambda: cluster.status(NS, "demo")["engines"]["desired"] == 1 and cluster.status(NS, "demo"))
    assert st["selector"] == ("app.kubernetes.io/name=megatron-serve,app.kubernetes.io/instance=demo,"
                              "app.kubernetes.io/component=engine")
    scale = await cluster.must("GET", cluster.mi_path(NS, "demo", "scale"))
    assert scale["spec"]["replicas"] == 1


async def test_lifecycle_walks_the_coordinator(cluster):
    _, _, fake = await start(cluster)

    async def go(lifecycle: str, phase: str) -> dict[str, Any]:
        await cluster.patch_mi(NS, "demo", {"spec": {"lifecycle": lifecycle}})
        return await wait_for(lambda: (st := cluster.status(NS, "demo")).get("phase") == phase
                              and st["lifecycle"]["observed"] == lifecycle and st, what=f"{lifecycle}/{phase}")

    st = await go("Paused", "Paused")
    assert fake.commands == ["pause"] and fake.state == "PAUSED"
    assert conditions(st)["LifecycleSynced"] == "True"
    await go("Suspended", "Suspended")
    assert fake.commands == ["pause", "suspend"]
    await go("Running", "Ready")
    assert fake.commands[2:] == ["resume", "unpause"]
    # Running -> Suspended is PAUSE then SUSPEND
    await go("Suspended", "Suspended")
    assert fake.commands[4:] == ["pause", "suspend"]

    # Shutdown: STOP, then engine StatefulSets scale to zero
    st = await go("Shutdown", "Shutdown")
    assert fake.commands[6:] == ["stop"]
    assert all(cluster.emu.find("statefulsets", NS, n)["spec"]["replicas"] == 0 for n in engine_names(cluster))
    assert st["engines"]["desired"] == 0
    # back to Running: scale up, then UNPAUSE restarts the fleet
    await go("Running", "Ready")
    assert fake.commands[7:] == ["unpause"]
    assert all(cluster.emu.find("statefulsets", NS, n)["spec"]["replicas"] == 1 for n in engine_names(cluster))

    # a restarted coordinator comes back RUNNING: the timer re-applies the desired state
    await go("Paused", "Paused")
    fake.restart()
    await wait_for(lambda: fake.state == "PAUSED" and fake.commands[-1] == "pause", what="re-paused")
    # an unreachable coordinator shows in the conditions, then converges again
    fake.up = False
    await wait_for(lambda: conditions(cluster.status(NS, "demo")).get("CoordinatorReady") == "False",
                   what="CoordinatorReady False")
    assert cluster.status(NS, "demo")["phase"] == "Degraded"
    fake.restart()
    fake.up = True
    await wait_for(lambda: cluster.status(NS, "demo").get("phase") == "Paused" and fake.state == "PAUSED",
                   what="converged after the outage")
    assert fake.rejected_tokens == 0


async def test_pause_mode_goes_with_every_pause_of_the_walk_and_a_bad_one_is_refused(cluster):
    _, _, fake = await start(cluster)

    async def go(patch: dict[str, Any], phase: str) -> dict[str, Any]:
        await cluster.patch_mi(NS, "demo", {"spec": patch})
        lifecycle = patch.get("lifecycle")
        return await wait_for(lambda: (st := cluster.status(NS, "demo")).get("phase") == phase
                              and (lifecycle is None or st["lifecycle"]["observed"] == lifecycle) and st,
                              what=f"{patch} -> {phase}")

    await go({"lifecycle": "Paused"}, "Paused")
    assert (fake.pause_modes, fake.pause_drains) == (["keep"], [None])  # the default: Keep
    await go({"lifecycle": "Running"}, "Ready")
    st = await go({"lifecycle": "Paused", "pauseMode": "Abort"}, "Paused")
    assert fake.pause_modes[-1] == "abort" and st["lifecycle"]["message"].startswith("PAUSE (abort) acknowledged")
    await go({"lifecycle": "Running", "pauseMode": "Wait", "drainTimeoutSeconds": 45}, "Ready")
    await go({"lifecycle": "Suspended"}, "Suspended")  # Running -> Suspended: its PAUSE waits too
    assert fake.commands[-2:] == ["pause", "suspend"]
    assert (fake.pause_modes[-1], fake.pause_drains[-1]) == ("wait", 45.0)
    assert fake.suspend_keep_kv == [False]  # the default: a plain suspend
    await go({"lifecycle": "Running"}, "Ready")
    st = await go({"lifecycle": "Suspended", "suspendKeepKV": True}, "Suspended")
    assert fake.suspend_keep_kv == [False, True] and "SUSPEND (keep_kv) acknowledged" in st["lifecycle"]["message"]
    sent = len(fake.commands)
    # the emulator does not check the schema's enum: the operator's own validation names the field
    await cluster.patch_mi(NS, "demo", {"spec": {"pauseMode": "Later", "lifecycle": "Running"}})
    st = await wait_for(lambda: (s := cluster.status(NS, "demo")).get("phase") == "Failed" and s, what="Failed")
    spec_valid = next(c for c in st["conditions"] if c["type"] == "SpecValid")
    assert spec_valid["status"] == "False" and "spec.pauseMode: unsupported value 'Later'" in spec_valid["message"]
    assert len(fake.commands) == sent and fake.state == "SUSPENDED"  # nothing was sent


async def test_invalid_spec_sets_specvalid_false_and_leaves_children(cluster):
    await start(cluster)
    before = cluster.children(NS, "demo")
    rv = cluster.emu.rv
    # the emulator does not run CEL: this slips past the CRD like an old/buggy API server would
    await cluster.patch_mi(NS, "demo", {"spec": {"parallelism": {"tensor": 3}}})
    st = await wait_for(lambda: (s := cluster.status(NS, "demo")).get("phase") == "Failed" and s, what="Failed")
    spec_valid = next(c for c in st["conditions"] if c["type"] == "SpecValid")
    assert spec_valid["status"] == "False" and spec_valid["reason"] == "InvalidSpec"
    assert "multiple or a divisor of engine.gpusPerPod" in spec_valid["message"]
    assert st["observedGeneration"] == cluster.mi(NS, "demo")["metadata"]["generation"]
    changes = [m for m in cluster.emu.mutations_since(rv) if m[2] not in ("events", "megatroninferences")]
    assert changes == [] and cluster.children(NS, "demo") == before
    assert "multiple or a divisor" in (await posted(cluster, NS, "InvalidSpec"))[0]
    # fixing the spec recovers
    await cluster.patch_mi(NS, "demo", {"spec": {"parallelism": {"tensor": 2}}})
    await wait_for(lambda: cluster.status(NS, "demo").get("phase") == "Ready", what="Ready again")


async def test_image_change_rolls_one_group_at_a_time(cluster):
    await start(cluster, data=3)
    names = engine_names(cluster)
    cluster.hold.update(names)  # pods of updated groups do not become ready until released
    await cluster.patch_mi(NS, "demo", {"spec": {"image": "example.com/megatron-serve:new"}})

    def images() -> list[str]:
        return [cluster.emu.find("statefulsets", NS, n)["spec"]["template"]["spec"]["containers"][0]["image"]
                for n in names]

    await wait_for(lambda: images()[0].endswith(":new"), what="group 0 rolled")
    deploy = cluster.emu.find("deployments", NS, "demo-coordinator")
    assert deploy["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":new")
    passes = lambda: sum(1 for c in cluster.emu.api_calls if c[0] == "get" and c[2] == "secrets")  # noqa: E731
    seen = passes()
    await wait_for(lambda: passes() >= seen + 6, what="more reconcile passes")
    assert [i.endswith(":new") for i in images()] == [True, False, False]
    cluster.hold.discard(names[0])
    await wait_for(lambda: images()[1].endswith(":new"), what="group 1 rolled")
    assert not images()[2].endswith(":new")
    cluster.hold.clear()
    await wait_for(lambda: all(i.endswith(":new") for i in images()), what="all groups rolled")
    await wait_for(lambda: cluster.status(NS, "demo").get("phase") == "Ready", what="Ready after the roll")


async def test_operator_restart_converges_and_adopts(cluster):
    await cluster.install_crd()
    cluster.start_controllers()
    resource = base_resource("demo", 1)
    live = await cluster.apply(copy.deepcopy(resource))
    # an unowned object with a child's name already exists: the operator adopts it
    await cluster.must("POST", f"/api/v1/namespaces/{NS}/services", {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "demo-coordinator", "namespace": NS},
        "spec": {"ports": [{"port": 1234}], "selector": {"app": "old"}}})
    fake = fake_coordinator_for(cluster, NS, "demo")
    await cluster.start_operator(fake)
    await wait_for(lambda: cluster.status(NS, "demo").get("phase") == "Ready", what="Ready")
    svc = cluster.emu.find("services", NS, "demo-coordinator")
    assert svc["metadata"]["ownerReferences"][0]["uid"] == live["metadata"]["uid"]
    assert svc["spec"]["ports"][0]["port"] == 5555

    await cluster.stop_operator()
    await cluster.patch_mi(NS, "demo", {"spec": {"lifecycle": "Suspended", "parallelism": {"data": 2}}})
    assert fake.state == "RUNNING"
    await cluster.start_operator(fake)
    await wait_for(lambda: cluster.status(NS, "demo").get("phase") == "Suspended"
                   and cluster.status(NS, "demo")["engines"]["ready"] == 2, what="converged after restart")
    assert fake.commands == ["pause", "suspend"]


async def test_delete_runs_the_finalizer(cluster):
    _, live, fake = await start(cluster)
    mi = cluster.mi(NS, "demo")
    assert "serving.megatron.dev/finalizer" in mi["metadata"]["finalizers"]
    await cluster.must("DELETE", cluster.mi_path(NS, "demo"))
    await wait_for(lambda: cluster.mi(NS, "demo") is None, what="resource deleted")
    assert fake.commands[-1] == "stop"
    # the emulator garbage-collects owned children, as the real API server does
    await wait_for(lambda: cluster.children(NS, "demo") == {}, what="children collected")


async def test_rbac_covers_every_call_and_nothing_more(cluster):
    """Every API call of the operator process (kopf's and ours) is granted by kube.PERMISSIONS,
    which the chart and kustomize RBAC equal (test_operator_chart), and every permission is used."""
    from megatron_operator.kube import PERMISSIONS

    await cluster.install_crd()
    cluster.start_controllers()
    # a Secret of the child's name that nobody owns: adopted (secrets: patch)
    await cluster.must("POST", f"/api/v1/namespaces/{NS}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "demo-coordinator-token", "namespace": NS},
        "data": {"token": "c2VjcmV0"}})
    resource = base_resource("demo", 2)
    await cluster.apply(copy.deepcopy(resource))
    await cluster.apply(base_resource("side", 0))  # no existing Secret here (secrets: create)
    fake = fake_coordinator_for(cluster, NS, "demo")
    await cluster.start_operator(fake)
    await wait_for(lambda: cluster.status(NS, "demo").get("phase") == "Ready", what="Ready")
    await wait_for(lambda: cluster.token_of(NS, "side"), what="the other resource's Secret")
    assert cluster.token_of(NS, "demo") == "secret"  # an existing token is kept, never rotated
    # scale down (list/delete), new image (deployments patch), new port (services/networkpolicies patch), two
    # groups' pods may go at once (poddisruptionbudgets patch)
    await cluster.patch_mi(NS, "demo", {"spec": {"image": "example.com/x:2", "server": {"port": 8080},
                                                 "parallelism": {"data": 1},
                                                 "disruptionBudget": {"maxUnavailableGroups": 2}}})
    await wait_for(lambda: engine_names(cluster) == ["demo-engine-0"] and
                   cluster.status(NS, "demo").get("phase") == "Ready", what="scaled down and Ready")
    await wait_for(lambda: (cluster.emu.find("poddisruptionbudgets", NS, "demo-engine") or {}).get("spec", {})
                   .get("minAvailable") == 0, what="the engine budget patched (one group, two may go: none kept)")
    # no budgets any more (poddisruptionbudgets delete)
    await cluster.patch_mi(NS, "demo", {"spec": {"disruptionBudget": {"enabled": False}}})
    await wait_for(lambda: cluster.emu.find("poddisruptionbudgets", NS, "demo-engine") is None,
                   what="the budgets deleted")
    await cluster.must("DELETE", cluster.mi_path(NS, "demo"))
    await wait_for(lambda: cluster.mi(NS, "demo") is None, what="deleted")
    await cluster.stop_operator()

    granted = {(group, resource, verb) for group, resource, verbs in PERMISSIONS for verb in verbs}
    used = {(group, plural, verb) for verb, group, plural, _ in cluster.emu.calls_by("kopf/", "megatron-operator/")}
    assert used - granted == set(), "calls without a permission"
    # the gangs' permissions are used by test_gang.py (a LeaderWorkerSet needs its CRD, a restart needs pods)
    gang_only = {("leaderworkerset.x-k8s.io", "leaderworkersets"), ("", "pods")}
    assert {(g, r, v) for g, r, v in granted - used if (g, r) not in gang_only} == set(), "permissions never used"


async def test_the_api_double_keeps_no_history_of_the_requests_it_served(cluster):
    """kmock re-applies its filters to every request it kept to route each GET: kept, each request of a long test
    cost more than the last (StrictKubernetesEmulator._handle). The double's own record is ``api_calls``."""
    for _ in range(20):
        code, _ = await cluster.request("GET", f"/api/v1/namespaces/{NS}/pods/absent")
        assert code == 404
    assert len(cluster.emu) == 0
    assert cluster.emu.api_calls.count(("get", "", "pods", NS)) == 20
