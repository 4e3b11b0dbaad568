"""New weights through the operator (fake coordinator in-process, strict KMock emulator).

Changing ``spec.model.path`` or ``spec.model.revision`` on a serving resource refits in place
(PAUSE, REFIT, UNPAUSE; no pod template changes), records ``status.model`` and posts an Event;
a paused fleet is refitted without touching its lifecycle; a coordinator that lost the epoch is
refitted again; weights the engines refuse fall back to rolling the pods onto the new path.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from .helpers import ROOT, fake_coordinator_for, load_yaml, posted, wait_for

pytestmark = pytest.mark.timeout(120)

NS = "default"
OLD, NEW, WIDE = "/models/qwen2.5-14b-instruct", "/models/qwen2.5-14b-step-200", "/models/wider"


async def start(cluster) -> Any:
    (doc,) = load_yaml(ROOT / "manifests" / "examples" / "tp2-dp4.yaml")
    resource = copy.deepcopy(doc)
    resource["metadata"] = {"name": "demo", "namespace": NS}
    resource["spec"]["parallelism"]["data"] = 2
    await cluster.install_crd()
    cluster.start_controllers()
    await cluster.apply(resource)
    fake = fake_coordinator_for(cluster, NS, "demo")
    await cluster.start_operator(fake)
    await wait_for(lambda: cluster.status(NS, "demo").get("phase") == "Ready", what="Ready")
    return fake


def templates(cluster) -> dict[str, tuple[Any, Any]]:
    """Pod templates (and generations) of every workload child: a refit must not change any."""
    out = {}
    for plural in ("statefulsets", "deployments"):
        for obj in cluster.emu.objects_of(plural, NS):
            out[obj["metadata"]["name"]] = (copy.deepcopy(obj["spec"]["template"]), obj["metadata"]["generation"])
    return out


def args_of(cluster, name: str) -> list[str]:
    return cluster.emu.find("statefulsets", NS, name)["spec"]["template"]["spec"]["containers"][0]["args"]


async def test_new_weights_refit_in_place_and_incompatible_ones_roll(cluster):
    fake = await start(cluster)
    assert cluster.status(NS, "demo")["model"] == {"path": OLD, "epoch": 0, "templatePath": OLD}
    before = templates(cluster)

    await cluster.patch_mi(NS, "demo", {"spec": {"model": {"path": NEW}}})
    st = await wait_for(lambda: (s := cluster.status(NS, "demo")).get("model", {}).get("epoch") == 1 and s,
                        what="status.model.epoch 1")
    assert fake.commands == ["pause", "refit", "unpause"] and fake.state == "RUNNING"
    assert fake.weights == NEW and fake.epoch == 1
    assert st["model"]["path"] == NEW and st["model"]["templatePath"] == OLD and st["model"]["refittedAt"]
    assert templates(cluster) == before  # no pod rolled
    assert OLD in args_of(cluster, "demo-engine-0")
    refitted = await posted(cluster, NS, "Refitted")
    assert len(refitted) == 1 and "epoch 1" in refitted[0]
    await wait_for(lambda: cluster.status(NS, "demo").get("phase") == "Ready", what="Ready after the refit")

    # a new revision of the same path refits again; on a paused fleet without pausing or unpausing
    await cluster.patch_mi(NS, "demo", {"spec": {"lifecycle": "Paused"}})
    await wait_for(lambda: fake.state == "PAUSED" and cluster.status(NS, "demo").get("phase") == "Paused",
                   what="Paused")
    await cluster.patch_mi(NS, "demo", {"spec": {"model": {"revision": "step-300"}}})
    st = await wait_for(lambda: (s := cluster.status(NS, "demo"))["model"]["epoch"] == 2 and s, what="epoch 2")
    assert st["model"]["revision"] == "step-300" and fake.commands[3:] == ["pause", "refit"]
    assert fake.state == "PAUSED" and templates(cluster) == before

    # a coordinator restarted along with its engines lost the refit: the next pass loads it again
    fake.forget_weights()
    await wait_for(lambda: fake.epoch == 2 and fake.weights == NEW, what="the weights restored")
    assert fake.commands[5:] == ["refit"] and templates(cluster) == before

    # weights the engines refuse: the fleet keeps the old ones, and the pods roll onto the new path
    await cluster.patch_mi(NS, "demo", {"spec": {"lifecycle": "Running"}})
    await wait_for(lambda: fake.state == "RUNNING", what="Running")
    fake.incompatible.add(WIDE)
    await cluster.patch_mi(NS, "demo", {"spec": {"model": {"path": WIDE, "revision": None}}})
    st = await wait_for(lambda: (s := cluster.status(NS, "demo"))["model"]["templatePath"] == WIDE and s,
                        what="the template takes the new path")
    assert st["model"] == {"path": WIDE, "epoch": 0, "templatePath": WIDE}
    assert fake.commands[-2:] == ["pause", "unpause"] and fake.state == "RUNNING" and fake.weights == NEW
    await wait_for(lambda: WIDE in args_of(cluster, "demo-engine-0") and WIDE in args_of(cluster, "demo-engine-1"),
                   what="both groups rolled")
    deploy = cluster.emu.find("deployments", NS, "demo-coordinator")
    assert WIDE in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "hidden_size is 96" in (await posted(cluster, NS, "RefitFailed"))[-1]
    await wait_for(lambda: cluster.status(NS, "demo").get("phase") == "Ready", what="Ready after the roll")


def init_args(cluster, plural: str, name: str) -> list[list[str]]:
    pod = cluster.emu.find(plural, NS, name)["spec"]["template"]["spec"]
    return [c["args"] for c in pod.get("initContainers", [])]


async def test_a_new_hub_model_rolls_the_pods_and_a_later_refit_keeps_their_fetch(cluster):
    """Files of a new ``spec.model.hub`` exist only in pods whose init container fetched them: no refit, a roll."""
    fake = await start(cluster)
    hub, fetched = "org/new-model@v2", "/models/org/new-model@v2"
    await cluster.patch_mi(NS, "demo", {"spec": {"model": {"hub": hub, "path": None}}})
    st = await wait_for(lambda: (s := cluster.status(NS, "demo"))["model"]["templatePath"] == fetched and s,
                        what="the template takes the Hub model")
    assert st["model"] == {"path": fetched, "epoch": 0, "templatePath": fetched, "hub": hub, "templateHub": hub}
    assert "refit" not in fake.commands
    await wait_for(lambda: fetched in args_of(cluster, "demo-engine-1"), what="both groups rolled")
    assert init_args(cluster, "statefulsets", "demo-engine-0") == [["download", hub, "--local-dir", fetched]]
    assert init_args(cluster, "deployments", "demo-coordinator") == [
        ["download", hub, "--local-dir", fetched, "--skip-weights"]]

    # back to a directory on the volume: refitted in place; the pods keep fetching what their template fetches
    before = templates(cluster)
    await cluster.patch_mi(NS, "demo", {"spec": {"model": {"hub": None, "path": NEW}}})
    st = await wait_for(lambda: (s := cluster.status(NS, "demo"))["model"]["epoch"] == 1 and s, what="refitted")
    assert fake.weights == NEW and st["model"]["templateHub"] == hub and "hub" not in st["model"]
    assert templates(cluster) == before
