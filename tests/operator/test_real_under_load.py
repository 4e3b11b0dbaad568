"""A rolling update and a node drain under a steady load of streamed requests, on the real control plane with real
engine processes: the requests' counts (failed, truncated, repeated, different from an uninterrupted run) and the
longest gap a stream saw.

Real: kube-apiserver, the StatefulSet and disruption controllers, the scheduler, ``kubectl drain`` (the Eviction API
and the fleet's PodDisruptionBudget), the operator as a process with the chart's RBAC; the coordinator and the
engines as processes (the tiny test model on the CPU), the streams through the project's coordinator client.
Simulated: the pods run under kwok, with no kubelet, so :class:`Kubelet` plays its part for the engine pods: it
starts an engine process (``--group`` of the pod) for each Running engine pod, sends SIGTERM to it (the engine
drains: finishes or hands back its requests, which continue elsewhere from their tokens) when its pod goes, and
keeps the pod not Ready until its engine has registered with the coordinator (the engine pods' readiness probe's
meaning). kwok marks a new pod Ready the moment it runs, so there is a short window (a watch event's latency) in
which a pod counts as Ready before its engine registered; the operator reconciles every second.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pathlib
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import kubernetes
import pytest

from megatron_operator import names
from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.wire.request import RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams
from tests.helpers import Children, free_port

from .real_cluster import kube, kube_namespace  # noqa: F401 - the fixtures
from .real_fleet import Fleet, fleet  # noqa: F401 - the fixture
from .real_tools import condition, example, until

# Not in make test for now: on 2026-11-28 it passed in two CI runs (68 s) and was still running past 8 minutes in a
# third, in its streamed-load scenario (not yet diagnosed). Run it by hand with MEGATRON_UNDER_LOAD=1.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(os.environ.get("MEGATRON_UNDER_LOAD") != "1",
                                 reason="hung once in three CI runs (not yet diagnosed): MEGATRON_UNDER_LOAD=1 runs it")]

NAME = "tiny"
GROUPS = 2
STREAMS = 32
TOKENS = 24
DEADLINE = 15  # spec.rollout.progressDeadlineSeconds of the bad rollout
PARAMS = SamplingParams(temperature=0.0, num_tokens_to_generate=TOKENS, ignore_eos=True)


def _ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions", []))


class Kubelet:
    """One engine process per Running engine pod (see the module): started with the pod, SIGTERM when it goes, the pod
    Ready only once its engine registered."""

    def __init__(self, fleet: Fleet, children: Children, model: str, port: int, env: dict[str, str]):
        self.fleet, self.children, self.model, self.port, self.env = fleet, children, model, port, env
        self.engines: dict[str, tuple[int, subprocess.Popen]] = {}  # pod uid -> (group, its engine)
        self.registered: set[int] = set()  # the groups the coordinator lists a serving (not draining) engine of
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.api = kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(
            config_file=str(fleet.kubectl.kubeconfig)))
        self.watcher = threading.Thread(target=self._watch, daemon=True)

    def _set_ready(self, pod: dict[str, Any], ready: bool) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        conditions = [{**c, "status": "True" if ready else "False", "lastTransitionTime": now}
                      if c["type"] in ("Ready", "ContainersReady") else c for c in pod["status"]["conditions"]]
        try:
            self.api.patch_namespaced_pod_status(pod["metadata"]["name"], self.fleet.kubectl.namespace,
                                                 {"status": {"conditions": conditions}})
        except kubernetes.client.ApiException:
            pass  # gone meanwhile

    def _adopt(self, pod: dict[str, Any]) -> None:
        """A new Running pod: not Ready before its engine registered (kwok marked it Ready), and its engine."""
        uid = pod["metadata"]["uid"]
        if uid in self.engines or pod["status"].get("phase") != "Running" or "deletionTimestamp" in pod["metadata"]:
            return
        if _ready(pod):
            self._set_ready(pod, False)
        group = int(pod["metadata"]["labels"]["serving.megatron.dev/group"])
        self.engines[uid] = (group, self.children.engine(
            self.model, self.port, "--group", str(group), "--device", "cpu", "--dtype", "float32",
            "--drain-timeout", "5", env=self.env))

    def _watch(self) -> None:
        """Reacts to a new pod within the watch's latency (kwok marks it Ready the moment it runs)."""
        while not self.stopping.is_set():
            watch = kubernetes.watch.Watch()
            for event in watch.stream(self.api.list_namespaced_pod, self.fleet.kubectl.namespace,
                                      label_selector=names.engine_pod_selector(NAME), timeout_seconds=5):
                self._adopt(self.api.api_client.sanitize_for_serialization(event["object"]))
                if self.stopping.is_set():
                    watch.stop()

    def _run(self) -> None:
        while not self.stopping.is_set():
            pods = {p["metadata"]["uid"]: p for p in self.fleet.engine_pods(NAME)}
            for uid, pod in pods.items():
                running = pod["status"].get("phase") == "Running" and "deletionTimestamp" not in pod["metadata"]
                if running and uid not in self.engines:
                    self._adopt(pod)
                elif running and not _ready(pod) and self.engines[uid][0] in self.registered:
                    self._set_ready(pod, True)
            for uid, (_, engine) in list(self.engines.items()):
                pod = pods.get(uid)
                if (pod is None or "deletionTimestamp" in pod["metadata"]) and engine.poll() is None \
                        and engine.returncode is None and not getattr(engine, "told", False):
                    engine.send_signal(signal.SIGTERM)  # the kubelet's SIGTERM: the engine drains
                    engine.told = True  # type: ignore[attr-defined]
            self.stopping.wait(0.2)

    def start(self) -> "Kubelet":
        self.watcher.start()
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=30)
        self.watcher.join(timeout=30)


@dataclass
class Load:
    """``STREAMS`` streams, one after another per slot, until stopped: what each saw."""

    client: InferenceClient
    expected: dict[int, list[int]]
    failed: list[str] = field(default_factory=list)
    truncated: int = 0
    repeated: int = 0
    different: int = 0
    finished: int = 0
    worst_gap: float = 0.0
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def _slot(self, slot: int) -> None:
        prompt = [1 + slot, 7, 11, 13]
        while not self.stop.is_set():
            streamed: list[int] = []
            gaps: list[float] = []
            last = time.monotonic()

            async def one() -> Any:
                nonlocal last
                async for item in self.client.add_request_streaming(prompt, PARAMS):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                    if hasattr(item, "new_tokens"):
                        streamed.extend(item.new_tokens)
                    else:
                        return item
                raise AssertionError("the stream ended without a final request")

            try:
                final = await one()
            except Exception as exc:  # noqa: BLE001 - counted, with its message
                self.failed.append(f"{type(exc).__name__}: {exc}")
                continue
            if final.status is not RequestStatus.COMPLETED:
                self.failed.append(f"{final.status}: {final.error}")
                continue
            self.finished += 1
            self.worst_gap = max(self.worst_gap, max(gaps, default=0.0))
            tokens = list(final.generated_tokens)
            self.truncated += len(tokens) < TOKENS
            self.repeated += streamed != tokens  # a stream that saw tokens twice (or missed some)
            self.expected.setdefault(slot, tokens)
            self.different += tokens != self.expected[slot]

    async def run_until(self, done: Any) -> None:
        """Run the streams until ``done()`` (polled in a thread) is true; again after that adds to the counts."""
        self.stop = asyncio.Event()
        slots = [asyncio.create_task(self._slot(i)) for i in range(STREAMS)]
        while not await asyncio.to_thread(done):
            await asyncio.sleep(0.5)
        self.stop.set()
        await asyncio.gather(*slots)

    def line(self, label: str, took: float) -> str:
        return (f"{label}: {took:.0f}s, {self.finished} streams finished, {len(self.failed)} failed, {self.truncated} "
                f"truncated, {self.repeated} repeated, {self.different} differ from an uninterrupted run; longest gap "
                f"{self.worst_gap:.1f}s")


def test_a_rolling_update_and_a_node_drain_under_streamed_load(fleet: Fleet, tiny_model: str, tmp_path: pathlib.Path):
    kubectl = fleet.kubectl
    port = free_port()
    resource = example("single-gpu.yaml", kubectl.namespace)
    resource["metadata"]["name"] = NAME
    resource["spec"]["model"] = {"path": tiny_model, "dtype": "float32"}
    resource["spec"]["server"]["apiKeySecretRef"]["name"] = f"{NAME}-api-key"
    resource["spec"]["parallelism"]["data"] = GROUPS
    resource["spec"]["drainTimeoutSeconds"] = 5
    resource["spec"]["rollout"] = {"progressDeadlineSeconds": DEADLINE}
    resource["spec"]["engine"].update(fleet.gpu_pool(1))
    fleet.prerequisites(resource)
    fleet.operator(MEGATRON_OPERATOR_COORDINATOR_ADDRESS=f"tcp://127.0.0.1:{port}")
    kubectl.apply([resource])
    secret = until(lambda: kubectl.get("secret", f"{NAME}-coordinator-token"), 60, "the coordinator's Secret")
    token = base64.b64decode(secret["data"]["token"]).decode()
    children = Children(tmp_path)
    env = {"MEGATRON_SERVE_TOKEN": token, "MEGATRON_KERNELS": "reference"}
    children.coordinator(tiny_model, port, env=env)
    kubelet = Kubelet(fleet, children, tiny_model, port, env).start()

    async def scenario() -> list[str]:
        client = InferenceClient(f"tcp://127.0.0.1:{port}", token=token)
        await client.start(timeout=60)
        lines = []
        try:
            async def serving() -> set[int]:
                engines = (await client.status())["engines"]
                kubelet.registered = {int(e["group"]) for e in engines if e.get("state") != "DRAINING"}
                return kubelet.registered

            async def refresh() -> None:  # what the Kubelet's readiness reads
                while True:
                    try:
                        await serving()
                    except Exception:  # noqa: BLE001 - a slow status under load: the next one
                        pass
                    await asyncio.sleep(0.3)

            refresher = asyncio.create_task(refresh())

            async def settle() -> None:
                async def all_up() -> bool:
                    pods = fleet.engine_pods(NAME)
                    return await serving() == set(range(GROUPS)) and len(pods) == GROUPS and all(map(_ready, pods))
                while not await all_up():
                    await asyncio.sleep(0.5)

            await asyncio.wait_for(settle(), 300)
            expected: dict[int, list[int]] = {}
            warm = Load(client, expected)
            began = time.monotonic()
            await warm.run_until(lambda: time.monotonic() - began > 10)  # the uninterrupted run, for reference
            assert warm.failed == [] and warm.finished > 0, warm.failed[:3]

            # a rolling update: a new image tag
            before = {p["metadata"]["uid"] for p in fleet.engine_pods(NAME)}
            kubectl.run("patch", "mi", NAME, "--type=merge", "-p", json.dumps({"spec": {"image": "example.com/x:v2"}}))
            load = Load(client, expected)
            began = time.monotonic()

            def rolled() -> bool:
                pods = fleet.engine_pods(NAME)
                return (len(pods) == GROUPS and all(map(_ready, pods)) and not {p["metadata"]["uid"] for p in pods}
                        & before and kubelet.registered == set(range(GROUPS)))

            await load.run_until(rolled)
            lines.append(load.line("rolling update (2 groups)", time.monotonic() - began))
            rolling = load

            # a bad rollout: a GPU no node has; group 0 moves, is never placed, the rollout halts; then a revert
            def progressing() -> dict[str, Any]:
                return condition(fleet.mi(NAME), "Progressing")

            kubectl.run("patch", "mi", NAME, "--type=merge", "-p",
                        json.dumps({"spec": {"engine": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-B200"}}}}))
            load = Load(client, expected)
            began = time.monotonic()
            await load.run_until(lambda: progressing().get("reason") == "ProgressDeadlineExceeded")
            halted_after = time.monotonic() - began
            kubectl.run("patch", "mi", NAME, "--type=merge", "-p",
                        json.dumps({"spec": {"engine": {"nodeSelector": {"nvidia.com/gpu.product": None}}}}))

            def back() -> bool:
                pods = fleet.engine_pods(NAME)
                return (len(pods) == GROUPS and all(map(_ready, pods)) and kubelet.registered == set(range(GROUPS))
                        and progressing().get("reason") == "Complete")

            await load.run_until(back)
            lines.append(load.line(f"bad rollout halted after {halted_after:.0f}s (deadline {DEADLINE}s), reverted",
                                   time.monotonic() - began))
            bad = load

            # a node drain: both groups' pods on the pool's first node, a second node for their replacements
            fleet.gpu_pool(2)
            before = {p["metadata"]["uid"] for p in fleet.engine_pods(NAME)}
            budget = kubectl.get("pdb", f"{NAME}-engine").get("status")
            drain = subprocess.Popen([kubectl.binary, f"--kubeconfig={kubectl.kubeconfig}", "drain",
                                      f"{kubectl.namespace}-gpu-0", "--ignore-daemonsets", "--delete-emptydir-data",
                                      "--timeout=300s"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            load = Load(client, expected)
            began = time.monotonic()
            await load.run_until(lambda: drain.poll() is not None and rolled())
            lines.append(load.line("kubectl drain (2 groups, budget 1)", time.monotonic() - began))
            output = drain.communicate()[0]
            assert drain.returncode == 0, output
            lines.append(f"drain: evictions refused by the budget {output.count('disruption budget')}; budget "
                         f"before: {budget}")
            lines += [line for line in output.splitlines() if "evict" in line]
            for line in lines:
                print(line)
            for phase in (rolling, bad, load):
                assert phase.failed == [], phase.failed[:3]
                assert (phase.truncated, phase.repeated, phase.different) == (0, 0, 0)
                assert phase.finished > 0
            # Whether the budget refused the second eviction depends on the race described in the module (a
            # replacement counted Ready by kwok before its engine registered lets it through): printed, not asserted.
            return lines
        finally:
            refresher.cancel()
            client.close()

    try:
        asyncio.run(scenario())
    finally:
        kubelet.stop()
        children.kill_all()
