"""An engine StatefulSet recreated for an immutable field with streamed requests in flight: every stream completes,
and its greedy tokens equal an uninterrupted run's.

The immutable field: the StatefulSet of engine group 0 is replaced (by the test, while no operator runs) with one
that differs from what the operator renders in ``podManagementPolicy`` (``OrderedReady``), as an older operator
version would have left it; the test then starts the operator, as an upgrade does. Its patch gets the real API
server's 422 ("field is immutable"), and it deletes the StatefulSet with ``propagationPolicy: Orphan`` and creates it
again: the garbage collector takes the old StatefulSet's ownerReference off the pod, and the new StatefulSet's
controller adopts the pod (its name and labels are the new one's). The pod is never deleted.

What is real: the API server (its 422), the garbage collector's orphaning, the StatefulSet controller's adoption, the
operator as a process with the chart's ServiceAccount token, and the coordinator and engine processes (the tiny
model on the CPU), with streams through the project's coordinator client. Simulated: the pod runs under kwok, so
:class:`PodEngine` plays its kubelet: it starts the engine process when the pod runs and sends it SIGTERM (the engine
drains and hands its requests back) when the pod is being deleted or replaced. Asserted: the pod is the same pod
(same uid) before and after, now owned by the new StatefulSet; its engine was started once and never signalled; the
streams in flight when the new StatefulSet had adopted the pod, and every one before and after, completed with the
uninterrupted run's greedy tokens.

The control: the StatefulSet deleted as ``kubectl delete`` deletes (the garbage collector's default, background
propagation, which the operator used before) and recreated by the operator: the pod goes with it, its engine gets
SIGTERM, a new pod and engine come, and the streams wait for the new engine (their longest wait for a token exceeds
the recreate's; both printed: 0.6 s against 19.2 s on this project's loaded 2-core machine).
"""

from __future__ import annotations

import asyncio
import base64
import pathlib
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.wire.request import RequestStatus
from megatron_serve.wire.sampling_params import SamplingParams
from tests.helpers import Children, free_port

from .real_cluster import kube, kube_namespace  # noqa: F401 - the fixtures
from .real_fleet import Fleet, fleet  # noqa: F401 - the fixture
from .real_tools import example, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NAME = "tiny"
ENGINE = f"{NAME}-engine-0"
STREAMS = 8
TOKENS = 32
PARAMS = SamplingParams(temperature=0.0, num_tokens_to_generate=TOKENS, ignore_eos=True)


@dataclass
class Stream:
    slot: int
    began: float
    ended: float = 0.0
    tokens: list[int] = field(default_factory=list)
    error: str = ""
    gap: float = 0.0  # the longest wait for a stream's next item


async def _one(client: InferenceClient, slot: int) -> Stream:
    stream = Stream(slot, time.monotonic())
    streamed: list[int] = []
    last = stream.began
    try:
        async for item in client.add_request_streaming([1 + slot, 7, 11, 13], PARAMS):
            stream.gap, last = max(stream.gap, time.monotonic() - last), time.monotonic()
            if hasattr(item, "new_tokens"):
                streamed.extend(item.new_tokens)
                continue
            if item.status is not RequestStatus.COMPLETED:
                stream.error = f"{item.status}: {item.error}"
            elif list(item.generated_tokens) != streamed:
                stream.error = f"streamed {streamed}, final {list(item.generated_tokens)}"
            stream.tokens = list(item.generated_tokens)
    except Exception as exc:  # noqa: BLE001 - reported with its message
        stream.error = f"{type(exc).__name__}: {exc}"
    stream.ended = time.monotonic()
    return stream


async def _streams_until(client: InferenceClient, done: threading.Event) -> list[Stream]:
    """``STREAMS`` slots, each streaming one request after another until ``done`` is set."""
    async def slot(i: int) -> list[Stream]:
        out = []
        while not done.is_set():
            out.append(await _one(client, i))
        return out

    return [s for slot_streams in await asyncio.gather(*(slot(i) for i in range(STREAMS))) for s in slot_streams]


class PodEngine:
    """The kubelet's part for the one engine pod (see the module): an engine process for the pod while it runs,
    SIGTERM to it (the engine drains) once the pod is being deleted or another pod took its name."""

    def __init__(self, fleet: Fleet, start: Callable[[], subprocess.Popen]):
        self.fleet, self.start = fleet, start
        self.engine: subprocess.Popen | None = None
        self.pod: str | None = None
        self.started: list[str] = []  # the pods an engine was started for
        self.stopped: list[str] = []  # the pods whose engine got SIGTERM
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.wait(0.2):
            pod = _pod(self.fleet)
            uid = _uid(pod) if pod and pod["status"].get("phase") == "Running" \
                and "deletionTimestamp" not in pod["metadata"] else None
            if self.engine is not None and uid != self.pod:
                self.engine.send_signal(signal.SIGTERM)
                self.stopped.append(str(self.pod))
                self.engine = None
            if self.engine is None and uid is not None:
                self.engine, self.pod = self.start(), uid
                self.started.append(uid)

    def __enter__(self) -> "PodEngine":
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.done.set()
        self.thread.join(timeout=10)


def _uid(obj: dict[str, Any] | None) -> str | None:
    return (obj or {}).get("metadata", {}).get("uid")


def _owner(pod: dict[str, Any]) -> str | None:
    return next((r["uid"] for r in pod["metadata"].get("ownerReferences", []) if r.get("controller")), None)


def _pod(fleet: Fleet) -> dict[str, Any] | None:
    return fleet.kubectl.get("pod", f"{ENGINE}-0")


def _older_statefulset(fleet: Fleet) -> str:
    """Replace the operator's StatefulSet of group 0 by one with ``podManagementPolicy: OrderedReady`` (an older
    operator's), its pod kept and adopted by it; returns its uid."""
    kubectl = fleet.kubectl
    live = kubectl.get("statefulset", ENGINE)
    meta = {k: v for k, v in live["metadata"].items()
            if k in ("name", "namespace", "labels", "annotations", "ownerReferences")}
    older = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta,
             "spec": {**live["spec"], "podManagementPolicy": "OrderedReady"}}
    kubectl.run("delete", "statefulset", ENGINE, "--cascade=orphan", "--wait=true")
    kubectl.apply([older])
    uid = _uid(kubectl.get("statefulset", ENGINE))
    until(lambda: _owner(_pod(fleet) or {"metadata": {}}) == uid, 60, "the pod adopted by the older StatefulSet")
    return uid


def _report(label: str, streams: list[Stream], at: float, expected: dict[int, list[int]]) -> tuple[list[str], int]:
    """Print what the streams of one phase saw; returns the failed and how many were in flight across ``at``."""
    failed = [f"slot {s.slot}: {s.error}" for s in streams if s.error]
    failed += [f"slot {s.slot}: {s.tokens} != {expected[s.slot]}" for s in streams
               if not s.error and s.tokens != expected[s.slot]]
    across = sum(s.began < at < s.ended for s in streams)
    print(f"{label}: {len(streams)} streams, {across} in flight across it, {len(failed)} failed or different from "
          f"the uninterrupted run; longest wait for a token {max(s.gap for s in streams):.1f}s")
    return failed, across


def test_an_immutable_field_recreate_keeps_the_pods_and_the_streams_in_flight(
        fleet: Fleet, tiny_model: str, tmp_path: pathlib.Path):
    kubectl = fleet.kubectl
    port = free_port()
    resource = example("single-gpu.yaml", kubectl.namespace)
    resource["metadata"]["name"] = NAME
    resource["spec"]["model"] = {"path": tiny_model, "dtype": "float32"}
    resource["spec"]["server"]["apiKeySecretRef"]["name"] = f"{NAME}-api-key"
    resource["spec"]["drainTimeoutSeconds"] = 5
    fleet.prerequisites(resource)
    address = {"MEGATRON_OPERATOR_COORDINATOR_ADDRESS": f"tcp://127.0.0.1:{port}"}
    first = fleet.operator(**address)
    kubectl.apply([resource])
    secret = until(lambda: kubectl.get("secret", f"{NAME}-coordinator-token"), 60, "the coordinator's Secret")
    token = base64.b64decode(secret["data"]["token"]).decode()
    children = Children(tmp_path)
    env = {"MEGATRON_SERVE_TOKEN": token, "MEGATRON_KERNELS": "reference"}

    def start_engine() -> subprocess.Popen:
        return children.engine(tiny_model, port, "--group", "0", "--device", "cpu", "--dtype", "float32",
                               "--drain-timeout", "5", env=env)

    try:
        children.coordinator(tiny_model, port, env=env)
        with PodEngine(fleet, start_engine) as kubelet:
            until(lambda: ((fleet.mi(NAME) or {}).get("status") or {}).get("phase") == "Ready", 180,
                  "Ready with the coordinator and the pod's engine")
            first.stop()
            older = _older_statefulset(fleet)
            pod = _uid(_pod(fleet))
            assert kubelet.started == [pod] and kubelet.stopped == []

            async def under_load(change: Callable[[], None], changed: Callable[[], bool]) -> tuple[list[Stream], float]:
                """Streams in flight, then ``change()``; once ``changed()`` a few more seconds of streams."""
                client = InferenceClient(f"tcp://127.0.0.1:{port}", token=token)
                await client.start(timeout=60)
                try:
                    done = threading.Event()
                    load = asyncio.create_task(_streams_until(client, done))
                    await asyncio.sleep(1)
                    change()
                    await asyncio.to_thread(until, changed, 120, "the change")
                    at = time.monotonic()
                    await asyncio.sleep(3)
                    done.set()
                    return await load, at
                finally:
                    client.close()

            async def uninterrupted() -> list[Stream]:
                client = InferenceClient(f"tcp://127.0.0.1:{port}", token=token)
                await client.start(timeout=60)
                try:
                    return list(await asyncio.gather(*(_one(client, i) for i in range(STREAMS))))
                finally:
                    client.close()

            reference = asyncio.run(uninterrupted())
            assert [s.error for s in reference] == [""] * STREAMS
            expected = {s.slot: s.tokens for s in reference}
            assert all(len(t) == TOKENS for t in expected.values())

            # the upgraded operator: its first pass meets the older StatefulSet, gets 422, recreates it
            def recreated() -> bool:
                live = kubectl.get("statefulset", ENGINE)
                return _uid(live) not in (None, older) and _owner(_pod(fleet) or {"metadata": {}}) == _uid(live)

            streams, at = asyncio.run(under_load(lambda: fleet.operator(**address), recreated))
            failed, across = _report("the operator's recreate (pods orphaned and adopted)", streams, at, expected)
            assert failed == [] and across > 0
            longest = max(s.gap for s in streams)
            new = kubectl.get("statefulset", ENGINE)
            assert new["spec"]["podManagementPolicy"] == "Parallel"
            kept = _pod(fleet)
            assert _uid(kept) == pod and _owner(kept) == _uid(new)  # the same pod, now the new StatefulSet's
            assert kubelet.started == [pod] and kubelet.stopped == []  # its engine served on, never signalled
            recreating = [e["message"] for e in kubectl.events(NAME) if e.get("reason") == "Recreating"]
            assert recreating and "its pods kept for the new one" in recreating[0], recreating

            # the control: the StatefulSet deleted with the garbage collector's default (background) propagation,
            # as the operator deleted it before: the pod goes with it, its engine gets SIGTERM, a new pod and engine
            # come with the StatefulSet the operator recreates
            streams, at = asyncio.run(under_load(
                lambda: kubectl.run("delete", "statefulset", ENGINE, "--wait=false"),
                lambda: _uid(_pod(fleet)) not in (None, pod) and len(kubelet.started) == 2))
            _report("control: the StatefulSet deleted in the background", streams, at, expected)
            assert kubelet.stopped == [pod] and len(kubelet.started) == 2
            assert max(s.gap for s in streams) > longest  # the streams waited for the new engine
    finally:
        children.kill_all()
