"""kubectl (as the README tells users) against the strict emulator with the operator running:
apply the CRD and an example, patch its lifecycle, scale it, read the status, delete it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest

from .helpers import CRD_PATH, ROOT, fake_coordinator_for, wait_for

KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"
pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not os.path.exists(KUBECTL), reason="kubectl is not installed")]


async def kubectl(cluster, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        KUBECTL, "--kubeconfig", str(cluster.kubeconfig), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, f"kubectl {' '.join(args)}: {err.decode()}"
    assert b"Warning" not in err, err.decode()
    return out.decode()


async def test_kubectl_apply_patch_scale_delete(cluster):
    # The emulator serves no OpenAPI documents: --validate=false (docs/architecture.md, Tests).
    await kubectl(cluster, "apply", "--validate=false", "-f", str(CRD_PATH))
    cluster.start_controllers()
    example = ROOT / "manifests" / "examples" / "rl-rollout-paused.yaml"
    out = await kubectl(cluster, "apply", "--validate=false", "-f", str(example))
    assert "megatroninference.serving.megatron.dev/rollout created" in out
    fake = fake_coordinator_for(cluster, "default", "rollout")
    await cluster.start_operator(fake)

    async def observed() -> str:
        return await kubectl(cluster, "get", "mi", "rollout", "-o", "jsonpath={.status.lifecycle.observed}")

    await wait_for(lambda: cluster.status("default", "rollout").get("phase") == "Paused", what="Paused")
    assert await observed() == "Paused" and fake.commands == ["pause"]
    # the CRD's printer columns, as `kubectl get mi` shows them
    header, row = (await kubectl(cluster, "get", "mi")).splitlines()
    assert header.split() == ["NAME", "PHASE", "LIFECYCLE", "READY", "ENGINES", "ENDPOINT", "AGE"]
    assert row.split()[:5] == ["rollout", "Paused", "Paused", "8", "http://rollout.default.svc:8000/v1"]
    wide = (await kubectl(cluster, "get", "mi", "-o", "wide")).splitlines()[0].split()
    assert "DESIRED" in wide

    await kubectl(cluster, "patch", "mi", "rollout", "--type=merge", "-p", '{"spec":{"lifecycle":"Running"}}')
    await wait_for(lambda: cluster.status("default", "rollout").get("phase") == "Ready", what="Ready")
    assert await observed() == "Running" and fake.commands == ["pause", "unpause"]

    await kubectl(cluster, "patch", "mi", "rollout", "--type=merge", "-p", '{"spec":{"lifecycle":"Suspended"}}')
    await wait_for(lambda: cluster.status("default", "rollout").get("phase") == "Suspended", what="Suspended")
    assert fake.commands[2:] == ["pause", "suspend"]

    await kubectl(cluster, "scale", "mi", "rollout", "--replicas=2")
    await wait_for(lambda: cluster.status("default", "rollout").get("engines", {}).get("desired") == 2,
                   what="two engine groups")
    status = json.loads(await kubectl(cluster, "get", "mi", "rollout", "-o", "json"))["status"]
    assert status["endpoint"] == "http://rollout.default.svc:8000/v1"
    assert {c["type"] for c in status["conditions"]} == {"Ready", "CoordinatorReady", "EnginesReady",
                                                         "LifecycleSynced", "Progressing", "SpecValid"}
    assert "rollout" in await kubectl(cluster, "get", "megatroninferences", "-o", "name")

    await kubectl(cluster, "delete", "mi", "rollout", "--wait=false")
    await wait_for(lambda: cluster.mi("default", "rollout") is None, what="deleted")
    assert fake.commands[-1] == "stop"
