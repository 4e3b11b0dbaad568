"""kopf against the strict KMock emulator: children, status, idempotence, scaling, lifecycle,
invalid specs, rolling updates, restarts and the finalizer (fake coordinator in-process)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from conftest import ROOT, fake_coordinator_for, load_yaml, wait_for, with_uid

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

    return render(with_uid(resource, live), OperatorConfig.from_env(for_render=True), **kwargs)


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
