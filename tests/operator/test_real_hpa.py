"""A HorizontalPodAutoscaler scales a fleet 1 -> 3 -> 1 through its scale subresource, under a steady load of
streamed requests, on the real control plane with real engine processes; the metric comes from the fleet's own
``/metrics`` through the project's custom-metrics adapter (``megatron-serve metrics-adapter``).

Real: kube-apiserver and its aggregation layer (an APIService for ``custom.metrics.k8s.io/v1beta2`` whose Service
is an ExternalName ``localhost``: the aggregator dials the adapter on this machine, with its front-proxy client
certificate), the HPA controller in kube-controller-manager (which reads the metric through the aggregator and
writes ``/scale``), the StatefulSet controller, the scheduler, the operator as a process with the chart's RBAC; the
coordinator, the OpenAI server (whose ``/metrics`` the adapter scrapes) and the engines as processes (the tiny test
model on the CPU); the adapter as a process holding a ServiceAccount's token. Simulated: the kubelet. The engine
pods go to a GPU node of the test's own that kwok does not play (:mod:`.real_node` keeps it Ready with a Lease
heartbeat), where the kubelet stand-in (:mod:`.real_kubelet`) plays it: a new engine group is a new StatefulSet whose
pod the scheduler binds to that node; the stand-in marks the pod Running, starts a local engine process with that
``--group`` and marks the pod Ready only once the engine registered and serves; a group scaled away is a deleted
StatefulSet, whose engine gets SIGTERM and drains, and whose pod is gone only once its engine exited. The HPA's
current scale is the resource's ``status.engines.ready`` (the scale subresource's ``statusReplicasPath``), groups
whose pods are Ready: under kwok a new group's pod was Ready the moment it ran, before its engine had started (until
the stand-in's watch turned it back), and the operator could count a group that served nothing; here it counts only
groups that serve.

The control comes first, under the same load: with no custom-metrics API registered the HPA says the metric is
unavailable (``ScalingActive=False``, ``FailedGetObjectMetric``) and nothing scales.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.helpers import Children, free_port, metric_by_engine_group

from .real_cluster import kube, kube_namespace  # noqa: F401 - the fixtures
from .real_fleet import Fleet, fleet  # noqa: F401 - the fixture
from .real_engines import EnginesHere, engines_here  # noqa: F401 - the fixture
from .real_load import STREAMS, Load, uninterrupted
from .real_tools import condition, service_account_kubeconfig, until

pytestmark = [pytest.mark.slow, pytest.mark.scenario, pytest.mark.timeout(900)]

NAME = "tiny"
MAX_GROUPS = 3
#: Seconds each phase may take under load.
PHASE_TIMEOUT = 300
#: Requests per engine group the HPA aims at. The load's 32 streams want ceil(32 / 6) = 6 groups, capped at 3; with 3
#: groups serving the fleet held 22 of them at a time (each stream spends the rest between two requests, on a loaded
#: host), still ceil(22 / 6) = 4; fewer than 3 groups would need 12 or fewer. None want the minimum, 1.
PER_GROUP = 6
METRIC = "megatron_serve_requests"
SYNC_PERIOD = 5  # kube-controller-manager's --horizontal-pod-autoscaler-sync-period on tools/kube-cluster (default 15)
#: The HPA's scale-down stabilization window. The metric is a gauge read at one instant, and the streams, all of one
#: length, finish in waves: a read under the full load once found 11 requests (the rest finished and not yet sent
#: again), and with a window of 0 such a read scaled 3 -> 1 -> 3 under the load (two groups drained, no stream
#: failed). The window keeps the most groups wanted over its span, so the load's reads hold the scale: 4 reads of the
#: controller's (one a sync period).
DOWN_WINDOW = 4 * SYNC_PERIOD
APISERVICE = "v1beta2.custom.metrics.k8s.io"
ADAPTER_READER = "extension-apiserver-authentication-reader"  # the Role in kube-system that lets it read the CA


def _hpa(namespace: str) -> dict[str, Any]:
    """Scale on every request the fleet holds per engine group: up at once, down only to the most groups it wanted
    over the last :data:`DOWN_WINDOW` seconds (the default is 300 s; hpa-requests.yaml's 600 s: each step drains a
    group)."""
    target = {"apiVersion": "serving.megatron.dev/v1alpha1", "kind": "MegatronInference", "name": NAME}
    steps = [{"type": "Pods", "value": MAX_GROUPS, "periodSeconds": 15}]
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": NAME, "namespace": namespace},
            "spec": {"scaleTargetRef": target, "minReplicas": 1, "maxReplicas": MAX_GROUPS,
                     "metrics": [{"type": "Object", "object": {
                         "describedObject": target, "metric": {"name": METRIC},
                         "target": {"type": "AverageValue", "averageValue": str(PER_GROUP)}}}],
                     "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0, "policies": steps},
                                  "scaleDown": {"stabilizationWindowSeconds": DOWN_WINDOW, "policies": steps}}}}


class Adapter:
    """The adapter as a process on this machine, registered as the cluster's custom-metrics API: its serving
    certificate, a ServiceAccount that may read the front proxy's CA, an ExternalName Service and the APIService."""

    def __init__(self, fleet: Fleet, children: Children, workdir: pathlib.Path, metrics_url: str):
        self.fleet, self.children, self.workdir, self.metrics_url = fleet, children, workdir, metrics_url
        self.port = free_port()
        self.binding = f"metrics-adapter-{fleet.kubectl.namespace}"[:63]
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        kubectl = self.fleet.kubectl
        cert, key = self.workdir / "adapter.crt", self.workdir / "adapter.key"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", str(key),
                        "-out", str(cert), "-subj", "/CN=megatron-metrics-adapter",
                        "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True)
        kubectl.run("create", "serviceaccount", "metrics-adapter")
        kubectl.run("create", "rolebinding", self.binding, "-n", "kube-system", f"--role={ADAPTER_READER}",
                    f"--serviceaccount={kubectl.namespace}:metrics-adapter")
        kubeconfig = service_account_kubeconfig(kubectl, "metrics-adapter", self.workdir / "adapter.kubeconfig")
        self.process = self.children.spawn(
            ["metrics-adapter", "--bind-address=127.0.0.1", f"--secure-port={self.port}", f"--tls-cert-file={cert}",
             f"--tls-private-key-file={key}", f"--metrics-url={self.metrics_url}"], "metrics-adapter",
            env={"KUBECONFIG": str(kubeconfig)})

    def register(self) -> None:
        kubectl = self.fleet.kubectl
        kubectl.apply([
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "metrics-adapter"},
             "spec": {"type": "ExternalName", "externalName": "localhost",
                      "ports": [{"name": "https", "port": self.port}]}},
            {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": {"name": APISERVICE},
             "spec": {"group": "custom.metrics.k8s.io", "version": "v1beta2", "groupPriorityMinimum": 100,
                      "versionPriority": 100, "insecureSkipTLSVerify": True,
                      "service": {"name": "metrics-adapter", "namespace": kubectl.namespace, "port": self.port}}},
        ])

    def close(self) -> None:
        self.fleet.kubectl.run("delete", "apiservice", APISERVICE, "--ignore-not-found", check=False)
        self.fleet.kubectl.run("delete", "rolebinding", self.binding, "-n", "kube-system", "--ignore-not-found",
                               check=False)


def test_an_hpa_scales_the_fleet_1_3_1_on_its_own_metric_under_streamed_load(
        fleet: Fleet, tiny_model: str, tmp_path: pathlib.Path, engines_here: Callable[[int, str], EnginesHere]):
    kubectl = fleet.kubectl
    port, http_port = free_port(), free_port()
    resource = fleet.tiny_resource(NAME, tiny_model)
    resource["spec"]["parallelism"]["data"] = 1
    resource["spec"]["engine"].update(fleet.gpu_pool(1, kubelet=True))  # 8 GPUs: room for the 3 one-GPU groups
    fleet.prerequisites(resource)
    fleet.operator(MEGATRON_OPERATOR_COORDINATOR_ADDRESS=f"tcp://127.0.0.1:{port}")
    kubectl.apply([resource])
    here = engines_here(port, NAME)
    kubelet = here.kubelet
    here.children.spawn(["server", "--model", tiny_model, "--coordinator", here.address, "--host", "127.0.0.1",
                         "--port", str(http_port)], "server", here.env)
    server = f"http://127.0.0.1:{http_port}"
    adapter = Adapter(fleet, here.children, tmp_path, f"{server}/metrics")
    here.cleanup.callback(kubectl.run, "delete", "hpa", NAME, "--ignore-not-found", check=False)
    here.cleanup.callback(adapter.close)

    def groups() -> int:
        return int(fleet.mi(NAME)["spec"]["parallelism"]["data"])

    def hpa() -> dict[str, Any]:
        return kubectl.get("hpa", NAME) or {}

    def settled(count: int) -> bool:
        kubelet.check()
        # the stand-in's view first: it costs nothing, while a read of the resource is a kubectl process
        return kubelet.serving(count) and groups() == count

    def metric_now() -> float:
        """The metric as the HPA controller reads it: through the aggregation layer (a Quantity: ``12`` or
        ``12500m``)."""
        raw = kubectl.run("get", "--raw", f"/apis/custom.metrics.k8s.io/v1beta2/namespaces/{kubectl.namespace}/"
                                          f"megatroninferences.serving.megatron.dev/{NAME}/{METRIC}").stdout
        value = json.loads(raw)["items"][0]["value"]
        return float(value.removesuffix("m")) / 1000 if value.endswith("m") else float(value)

    async def under_load(load: Load, done: Any, what: str) -> None:
        await load.run_until(done, PHASE_TIMEOUT, what, check=kubelet.check, context=kubelet.describe)

    async def scenario() -> None:
        async with here.client() as client:
            await asyncio.to_thread(until, lambda: settled(1), PHASE_TIMEOUT, "one engine group serving")
            expected = await uninterrupted(client, PHASE_TIMEOUT, check=kubelet.check, context=kubelet.describe)

            # The control: the HPA under load, with no custom-metrics API registered. Past its condition, a sync
            # period more: it keeps its one group under the whole load.
            kubectl.apply([_hpa(kubectl.namespace)])
            control = Load(client, expected)
            began = time.monotonic()
            await under_load(control, lambda: time.monotonic() - began > SYNC_PERIOD + 5 and
                             condition(hpa(), "ScalingActive").get("status") == "False",
                             "the HPA's ScalingActive=False")
            unavailable = condition(hpa(), "ScalingActive")
            print(control.line(f"control, no adapter ({STREAMS} streams)", time.monotonic() - began))
            print(f"control: ScalingActive={unavailable['status']} {unavailable['reason']}: {unavailable['message']}")
            assert unavailable["reason"] == "FailedGetObjectMetric", unavailable
            assert METRIC in unavailable["message"] and "no custom metrics API" in unavailable["message"], unavailable
            assert groups() == 1 and len(kubelet.pods) == 1
            assert hpa()["status"]["currentReplicas"] == 1  # (its desiredReplicas is 0: none could be computed)

            # The adapter registered: the HPA reads the metric and scales 1 -> 3 under the same load.
            adapter.start()
            adapter.register()
            load = Load(client, expected)
            began = time.monotonic()
            marks: dict[str, float] = {}
            counts = [1]  # the resource's engine groups, each change as it was seen

            def seen() -> int:
                if (now := groups()) != counts[-1]:
                    counts.append(now)
                return now

            def three_serving() -> bool:
                if "scaled" not in marks and seen() == MAX_GROUPS:
                    marks["scaled"] = time.monotonic() - began
                if not settled(MAX_GROUPS):
                    return False
                tokens = metric_by_engine_group(server, "megatron_serve_generation_tokens_total")
                if not all(tokens.get(str(g), 0) > 0 for g in range(MAX_GROUPS)):  # every new group took requests
                    return False
                marks["value"] = metric_now()
                return True

            await under_load(load, three_serving, f"{MAX_GROUPS} engine groups serving, each with tokens generated")
            up = time.monotonic() - began
            print(load.line(f"scale up 1 -> {MAX_GROUPS}", up))
            ready_at: dict[int, float] = {}  # each new group's pod made Ready by the stand-in, once its engine served
            for at, kind, group, _ in kubelet.timeline:
                if kind == "ready" and group > 0:
                    ready_at.setdefault(group, at - began)
            print(f"scale up: the HPA wrote {MAX_GROUPS} groups to /scale {marks['scaled']:.0f}s after the adapter was "
                  f"registered; the new groups' pods Ready at "
                  f"{', '.join(f'{ready_at[g]:.0f}s' for g in sorted(ready_at))}; all {MAX_GROUPS} served at {up:.0f}s")
            assert condition(hpa(), "ScalingActive").get("status") == "True", hpa()["status"]

            # The load ends: the metric falls to 0, and past the scale-down window the HPA goes back to its minimum;
            # groups 2 and 1 drain.
            print(f"{METRIC} through the aggregator with {MAX_GROUPS} groups serving: {marks['value']:g} "
                  f"({marks['value'] / MAX_GROUPS:.1f} per group, target {PER_GROUP})")
            engines = dict(kubelet.engines)
            began = time.monotonic()
            await asyncio.to_thread(until, lambda: seen() == 1 and settled(1), PHASE_TIMEOUT,
                                    "the fleet back at one engine group")
            down = time.monotonic() - began
            gone = [process for group, process in engines.values() if group != 0]
            await asyncio.to_thread(until, lambda: all(p.poll() is not None for p in gone), 60,
                                    "the scaled-away engines to exit")
            print(f"scale down {MAX_GROUPS} -> 1 after the load ended: {down:.0f}s (window {DOWN_WINDOW}s); the "
                  f"scaled-away engines drained "
                  f"and exited with {sorted(p.returncode for p in gone)}")
            rescales = [e["message"] for e in kubectl.events(NAME) if e["reason"] == "SuccessfulRescale"
                        and e["involvedObject"]["kind"] == "HorizontalPodAutoscaler"]
            print("HPA events:", "; ".join(rescales), f"; engine groups seen: {counts}")
            for phase in (control, load):
                assert phase.failed == [], phase.failed[:3]
                assert (phase.truncated, phase.repeated, phase.different) == (0, 0, 0)
                assert phase.finished > 0
            # Up once, then down without going up again (through 2 when the window still held a wave's read).
            down_only = counts[1:] == sorted(counts[1:], reverse=True)
            assert counts[:2] == [1, MAX_GROUPS] and counts[-1] == 1 and down_only, counts
            assert [p.returncode for p in gone] == [0] * (MAX_GROUPS - 1)
            assert [m.split(";")[0] for m in rescales] == [f"New size: {MAX_GROUPS}", "New size: 1"], rescales

    asyncio.run(scenario())
