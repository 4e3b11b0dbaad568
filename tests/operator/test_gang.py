"""Engine groups that span nodes (spec.engine.parallelism), against the strict API-server double: one
gang per group (a LeaderWorkerSet where the cluster has its CRD, else a StatefulSet), status.groups
shows each rank, and a rank's pod deleted or restarted restarts the whole group."""

from __future__ import annotations

import copy
import functools
import gzip
from typing import Any

import pytest
import yaml

from .fake_pods import PodController
from .helpers import ROOT, FakeCoordinator, event_messages, posted, wait_for, with_uid

pytestmark = pytest.mark.timeout(120)

NS = "default"
NAME = "moe"
LWS_CRD = ROOT / "tests" / "operator" / "vendored_crds" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml.gz"


def moe_resource() -> dict[str, Any]:
    """The issue's layout: tensor 2, expert 2, data-parallel attention 2, on 8-GPU nodes: each attention rank is a
    pod of its own (of 1 GPU: its engine starts only its own ranks), so a group is 2 pods."""
    return {
        "apiVersion": "serving.megatron.dev/v1alpha1", "kind": "MegatronInference",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {
            "model": {"path": "/models/qwen3-30b-a3b", "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
            "engine": {"gpusPerPod": 8, "parallelism": {"tensor": 2, "expert": 2, "dataParallelAttention": 2}},
            "server": {"apiKeySecretRef": {"name": "api-key", "key": "key"}},
        },
    }


@functools.cache
def lws_crd() -> dict[str, Any]:
    """Read once, through libyaml where PyYAML has it: the pure-Python loader is slow on this large a document, and
    three tests send it (never change it)."""
    with gzip.open(LWS_CRD, "rt", encoding="utf-8") as f:
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def workload_ready(cluster, name: str) -> bool:
    for plural in ("statefulsets", "leaderworkersets"):
        obj = cluster.emu.find(plural, NS, name)
        if obj is not None:
            replicas = int(obj["spec"].get("replicas", 1))
            return replicas > 0 and int((obj.get("status") or {}).get("readyReplicas", 0)) >= replicas
    return False


async def start(cluster, with_lws: bool) -> tuple[dict[str, Any], PodController]:
    await cluster.install_crd()
    if with_lws:
        await cluster.must("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", lws_crd())
    pods = PodController(cluster, NS)
    pods.start()
    live = await cluster.apply(moe_resource())
    fake = FakeCoordinator(groups=lambda: [0] if workload_ready(cluster, f"{NAME}-engine-0") else [],
                           token=lambda: cluster.token_of(NS, NAME))
    await cluster.start_operator(fake)
    await wait_for(lambda: cluster.status(NS, NAME).get("phase") == "Ready", what="phase Ready")
    return live, pods


def ranks(cluster) -> list[dict[str, Any]]:
    (group,) = cluster.status(NS, NAME)["groups"]
    return group["ranks"]


def pod_uids(cluster) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.emu.objects_of("pods", NS)}


def operator_deleted_pods(cluster) -> list[str]:
    return [plural for verb, _, plural, _ in cluster.emu.calls_by("megatron-operator/")
            if verb == "delete" and plural == "pods"]


@pytest.mark.parametrize("with_lws", [False, True], ids=["statefulset", "leaderworkerset"])
async def test_one_gang_per_group_with_each_rank_in_status(cluster, with_lws):
    from megatron_operator.config import OperatorConfig
    from megatron_operator.reconcile import contains
    from megatron_operator.render import render

    live, pods = await start(cluster, with_lws)
    try:
        expected = render(with_uid(moe_resource(), live), OperatorConfig.from_env(), leader_worker_set=with_lws)
        engine = [o for o in expected if o["metadata"]["name"] == f"{NAME}-engine-0"]
        if with_lws:  # the gang is one LeaderWorkerSet; its controller makes the headless Service
            (lws,) = engine
            assert lws["kind"] == "LeaderWorkerSet"
            assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
            assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
            template = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
            assert cluster.emu.find("statefulsets", NS, f"{NAME}-engine-0") is None
            assert cluster.emu.find("services", NS, f"{NAME}-engine-0") is None
        else:
            assert [o["kind"] for o in engine] == ["Service", "StatefulSet"]
            template = engine[1]["spec"]["template"]
            assert engine[1]["spec"]["replicas"] == 2
        (container,) = template["spec"]["containers"]
        args = container["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == "1"  # each attention rank: 2 / 2
        assert args[args.index("--data-parallel-size") + 1] == "2" and "--enable-expert-parallel" in args
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert (env["WORLD_SIZE"], env["NNODES"], env["NPROC_PER_NODE"]) == ("2", "2", "1")
        plural = "leaderworkersets" if with_lws else "statefulsets"
        for obj in engine:
            have = cluster.emu.find(plural if obj["kind"] != "Service" else "services", NS, obj["metadata"]["name"])
            assert have is not None and contains(obj, have), obj["kind"]

        def both_ranks() -> list[dict[str, Any]] | None:
            found = ranks(cluster)
            return found if [r["rank"] for r in found] == [0, 1] and all(r["ready"] for r in found) else None

        found = await wait_for(both_ranks, what="both ranks in status.groups")
        names = pod_uids(cluster)
        leader = f"{NAME}-engine-0-0"
        worker = f"{NAME}-engine-0-0-1" if with_lws else f"{NAME}-engine-0-1"
        assert [(r["pod"], r["podUID"], r["firstRank"]) for r in found] == \
            [(leader, names[leader], 0), (worker, names[worker], 1)]
        (group,) = cluster.status(NS, NAME)["groups"]
        assert group["ready"] is True and group["workload"] == ("LeaderWorkerSet" if with_lws else "StatefulSet")
    finally:
        await pods.stop()


async def test_a_deleted_rank_restarts_its_statefulset_group(cluster):
    _, pods = await start(cluster, with_lws=False)
    try:
        leader, worker = f"{NAME}-engine-0-0", f"{NAME}-engine-0-1"
        first = await wait_for(lambda: (g := cluster.status(NS, NAME)["groups"][0]).get("startedWith")
                               and len(g["startedWith"]) == 2 and pod_uids(cluster), what="the gang recorded")
        await cluster.must("DELETE", f"/api/v1/namespaces/{NS}/pods/{worker}")

        # the worker comes back (the StatefulSet controller), and the operator restarts the leader with it
        def restarted() -> dict[str, str] | None:
            uids = pod_uids(cluster)
            started = {m["rank"]: m["podUID"] for m in cluster.status(NS, NAME)["groups"][0].get("startedWith", [])}
            fresh = uids.get(leader) not in (None, first[leader]) and uids.get(worker) not in (None, first[worker])
            return uids if fresh and started == {0: uids[leader], 1: uids[worker]} else None

        second = await wait_for(restarted, what="both ranks on new pods, recorded")
        (message,) = await posted(cluster, NS, "GroupRestart")
        assert leader in message and worker not in message.split("(")[1]
        assert operator_deleted_pods(cluster) == ["pods"]  # the leader, once

        # a rank whose engine container restarted (same pod): the other pod is restarted, this one kept
        await cluster.emu.set_status("pods", NS, worker, {"containerStatuses": [
            {"name": "engine", "ready": True, "restartCount": 1}]})
        third = await wait_for(lambda: (u := pod_uids(cluster)).get(leader) not in (None, second[leader]) and u,
                               what="the leader restarted with the worker")
        assert third[worker] == second[worker]
        await wait_for(lambda: {(m["rank"], m["restarts"]) for m in
                                cluster.status(NS, NAME)["groups"][0].get("startedWith", [])} == {(0, 0), (1, 1)},
                       what="the new start recorded")
        assert len(operator_deleted_pods(cluster)) == 2
        assert len(event_messages(cluster, NS, "GroupRestart")) == 2
        assert_gang_permissions(cluster, {("", "pods")})
    finally:
        await pods.stop()


async def test_leaderworkerset_groups_are_restarted_by_their_controller_not_the_operator(cluster):
    """With the LWS CRD the operator deletes no pod (RecreateGroupOnPodRestart is the controller's); its
    status follows the pods that come back."""
    _, pods = await start(cluster, with_lws=True)
    try:
        worker = f"{NAME}-engine-0-0-1"
        first = await wait_for(lambda: len(ranks(cluster)) == 2 and pod_uids(cluster), what="two ranks")
        await cluster.must("DELETE", f"/api/v1/namespaces/{NS}/pods/{worker}")
        await wait_for(lambda: any(r["pod"] == worker and r["podUID"] not in (None, first[worker])
                                   for r in ranks(cluster)), what="the new worker in status")
        assert operator_deleted_pods(cluster) == []
        assert "startedWith" not in cluster.status(NS, NAME)["groups"][0]

        # a new image patches the LeaderWorkerSet's template; no groups deletes it
        await cluster.patch_mi(NS, NAME, {"spec": {"image": "example.com/x:2"}})
        await wait_for(lambda: (o := cluster.emu.find("leaderworkersets", NS, f"{NAME}-engine-0")) and o["spec"][
            "leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["image"] == "example.com/x:2",
            what="the LeaderWorkerSet patched")
        await cluster.patch_mi(NS, NAME, {"spec": {"parallelism": {"data": 0}}})
        await wait_for(lambda: cluster.emu.find("leaderworkersets", NS, f"{NAME}-engine-0") is None,
                       what="the LeaderWorkerSet deleted")
        assert_gang_permissions(cluster, {("leaderworkerset.x-k8s.io", "leaderworkersets")})
    finally:
        await pods.stop()


def assert_gang_permissions(cluster, resources: set[tuple[str, str]]) -> None:
    """Every call the operator made is granted, and each of ``resources``' permissions was used."""
    from megatron_operator.kube import PERMISSIONS

    granted = {(group, resource, verb) for group, resource, verbs in PERMISSIONS for verb in verbs}
    used = {(group, plural, verb) for verb, group, plural, _ in cluster.emu.calls_by("kopf/", "megatron-operator/")}
    assert used - granted == set(), "calls without a permission"
    assert {p for p in granted if p[:2] in resources} - used == set(), "permissions never used"


def test_existing_resources_render_no_gang():
    """Without spec.engine.parallelism the groups are the StatefulSets they were, and no LWS appears."""
    from megatron_operator.config import OperatorConfig
    from megatron_operator.render import render

    (doc,) = yaml.safe_load_all((ROOT / "manifests" / "examples" / "multi-node.yaml").read_text())
    config = OperatorConfig(token_key=b"k")
    assert render(copy.deepcopy(doc), config, leader_worker_set=True) == render(doc, config)


async def test_the_lws_crd_installed_later_moves_the_gang_to_a_leaderworkerset(cluster):
    """Detected through the API on every pass: the StatefulSet and its Service give way to the LeaderWorkerSet.

    The move takes several passes (the old gang's pods go, the new gang's come up and turn ready): 5 to 8 s here
    when quiet, past 20 s on a loaded CI machine, hence the longer deadlines."""
    _, pods = await start(cluster, with_lws=False)
    try:
        assert cluster.emu.find("statefulsets", NS, f"{NAME}-engine-0") is not None
        await cluster.must("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", lws_crd())
        await wait_for(lambda: cluster.emu.find("leaderworkersets", NS, f"{NAME}-engine-0") is not None
                       and cluster.emu.find("statefulsets", NS, f"{NAME}-engine-0") is None
                       and cluster.emu.find("services", NS, f"{NAME}-engine-0") is None, timeout=60, what="the LeaderWorkerSet alone")
        await wait_for(lambda: (g := cluster.status(NS, NAME)["groups"][0])["workload"] == "LeaderWorkerSet"
                       and g["ready"], timeout=60, what="the group ready as a LeaderWorkerSet")
    finally:
        await pods.stop()


async def test_pods_made_for_a_workload_deleted_meanwhile_are_collected(cluster):
    """The pod controller acting on a view from before the operator deleted the workload (a gang's move to a
    LeaderWorkerSet deletes the StatefulSet while its pods are being made): those pods are the API server's garbage,
    not squatters on the names the LeaderWorkerSet's pods need, and the controller goes on. (Before, the leader's name
    stayed taken, the controller died on the vanished workload's status, and the group never came up.)"""
    labels = {"app": NAME}
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": f"{NAME}-engine-0", "namespace": NS},
           "spec": {"replicas": 2, "selector": {"matchLabels": labels}, "template": {
               "metadata": {"labels": labels}, "spec": {"containers": [{"name": "engine", "image": "x"}]}}}}
    path = f"/apis/apps/v1/namespaces/{NS}/statefulsets"
    pods = PodController(cluster, NS)
    stale = await cluster.must("POST", path, sts)
    await cluster.must("DELETE", f"{path}/{NAME}-engine-0")
    await pods.sync(stale)
    assert pod_uids(cluster) == {}
    live = await cluster.must("POST", path, sts)  # the control: the same view of a live workload gets its pods
    await pods.sync(live)
    assert sorted(pod_uids(cluster)) == [f"{NAME}-engine-0-0", f"{NAME}-engine-0-1"]
    assert cluster.emu.find("statefulsets", NS, f"{NAME}-engine-0")["status"]["readyReplicas"] == 2
