"""Helpers of the operator suite: the strict KMock emulator cluster, kopf in its own thread,
a fake coordinator behind the operator's coordinator link, and fake workload controllers.

The fake coordinator replaces ``megatron_operator.coordinator_link`` in-process (it implements
the coordinator state machine of docs/architecture.md (Lifecycle) and checks the token) so the lifecycle logic
is tested without the runtime; ``test_operator_coordinator.py`` drives a real coordinator
process instead when the runtime provides one.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import copy
import glob
import os
import pathlib
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import yaml

from tests.helpers import until

# Before megatron_operator.handlers is imported: a fast timer and a fixed token key, so that
# render() predicts the operator's Secret.
os.environ.setdefault("MEGATRON_OPERATOR_RECONCILE_INTERVAL", "0.5")
os.environ.setdefault("MEGATRON_OPERATOR_TOKEN_KEY", "operator-tests-key")
os.environ.setdefault("MEGATRON_OPERATOR_CONNECT_TIMEOUT", "2")
os.environ.setdefault("MEGATRON_OPERATOR_COMMAND_TIMEOUT", "10")
# The kubernetes client reads $KUBECONFIG's *path* once, at import: keep one path for the whole
# session and rewrite the file for each test's emulator.
KUBECONFIG = pathlib.Path(tempfile.mkdtemp(prefix="megatron-operator-tests-")) / "kubeconfig"
atexit.register(shutil.rmtree, KUBECONFIG.parent, True)  # the session's, removed when it ends
os.environ["KUBECONFIG"] = str(KUBECONFIG)
import kubernetes.config.kube_config as _kube_config  # noqa: E402  (in case it was imported earlier)

_kube_config.KUBE_CONFIG_DEFAULT_LOCATION = str(KUBECONFIG)

NS = "default"
ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = sorted(glob.glob(str(ROOT / "manifests" / "examples" / "*.yaml")))
CRD_PATH = ROOT / "manifests" / "crds" / "serving.megatron.dev_megatroninferences.yaml"


def load_yaml(path: str | pathlib.Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def structural_json_schema(node: dict[str, Any]) -> dict[str, Any]:
    """openAPIV3Schema -> draft-4 JSON schema, with unknown fields forbidden (kubectl's strict
    field validation: the API server would drop them, the user would lose them silently)."""
    out = {k: v for k, v in node.items() if not k.startswith("x-kubernetes-") and k not in ("default", "format")}
    if "properties" in node:
        out["properties"] = {k: structural_json_schema(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(node.get("items"), dict):
        out["items"] = structural_json_schema(node["items"])
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = structural_json_schema(node["additionalProperties"])
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
    return out


async def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "condition",
                   interval: float = 0.05) -> Any:
    """:func:`tests.helpers.until` for an object the operator writes: a lookup into one not written yet (a key,
    an item or an attribute missing, a ``None`` indexed) counts as not yet."""
    return await until(predicate, timeout, what, interval, not_yet=(KeyError, TypeError, IndexError, AttributeError))



def event_messages(cluster: Any, namespace: str, reason: str) -> list[str]:
    """Messages of the Events with ``reason``, oldest first."""
    return [e["message"] for e in sorted(cluster.emu.objects_of("events", namespace),
                                         key=lambda e: int(e["metadata"]["resourceVersion"]))
            if e.get("reason") == reason]


async def posted(cluster: Any, namespace: str, reason: str, count: int = 1, timeout: float = 20.0) -> list[str]:
    """Wait for ``count`` Events with ``reason``; their messages, oldest first.

    kopf posts Events from a background task, after the handler's status patch: a test that saw
    the status change cannot expect the Event in the same instant.
    """
    return await wait_for(lambda: (found := event_messages(cluster, namespace, reason)) and len(found) >= count
                          and found, timeout=timeout, what=f"{count} {reason} Event(s)")

# --------------------------------------------------------------------------- fake coordinator

class FakeCoordinator:
    """The coordinator's lifecycle (the runtime's one table) behind the operator's link API."""

    def __init__(self, groups: Callable[[], list[int]], token: Callable[[], str | None]):
        self.state = "RUNNING"
        self.up = True
        self.commands: list[str] = []
        self.pause_modes: list[str | None] = []  # the mode of each PAUSE received
        self.pause_drains: list[float | None] = []  # and its drain_timeout
        self.suspend_keep_kv: list[bool] = []  # keep_kv of each SUSPEND received
        self.opened: list[str] = []
        self.groups = groups
        self.token = token
        self.rejected_tokens = 0
        self.epoch = 0  # weights generation (REFIT)
        self.weights: str | None = None
        self.incompatible: set[str] = set()  # sources every engine refuses (another architecture)

    def restart(self) -> None:
        """A new coordinator process: it starts RUNNING (and adopts the epoch its engines report)."""
        self.state = "RUNNING"

    def forget_weights(self) -> None:
        """A coordinator restarted together with all its engines: back on the pods' own model, epoch 0."""
        self.epoch, self.weights = 0, None

    async def open(self, address: str, token: str | None, timeout: float) -> "FakeLink":
        from megatron_operator.coordinator_link import CoordinatorUnavailable

        expected = self.token()
        if not self.up or expected is None:  # no Secret yet: no coordinator pod either
            raise CoordinatorUnavailable(f"cannot reach the coordinator at {address}: connection refused")
        if token != expected:
            self.rejected_tokens += 1
            raise CoordinatorUnavailable(f"{address}: HELLO rejected: bad token")
        self.opened.append(address)
        return FakeLink(self, address)


class FakeLink:
    def __init__(self, coordinator: FakeCoordinator, address: str):
        self.coordinator = coordinator
        self.address = address

    def _check(self) -> None:
        from megatron_operator.coordinator_link import CoordinatorUnavailable

        if not self.coordinator.up:
            raise CoordinatorUnavailable(f"{self.address}: connection lost")

    async def status(self, timeout: float) -> dict[str, Any]:
        self._check()
        c = self.coordinator
        engines = [{"id": f"engine-{g}", "group": g, "state": c.state, "running": 0, "waiting": 0,
                    "kv_blocks_free": 10, "kv_blocks_total": 10, "last_heartbeat": 0.0, "epoch": c.epoch}
                   for g in c.groups()] if c.state != "STOPPED" else []
        return {"state": c.state, "engines": engines, "queued": 0, "in_flight": 0, "completed": 0, "failed": 0,
                "epoch": c.epoch, "weights": c.weights}

    async def refit(self, source: str, epoch: int | None, timeout: float) -> dict[str, Any]:
        from megatron_operator.coordinator_link import CoordinatorRejected, RefitFailed

        self._check()
        c = self.coordinator
        if c.state not in ("PAUSED", "SUSPENDED"):
            raise CoordinatorRejected(f"REFIT rejected: only allowed while PAUSED or SUSPENDED; the fleet is {c.state}")
        if source in c.incompatible:
            raise RefitFailed(f"REFIT rejected: {source}: hidden_size is 96 but the serving model has 64")
        c.commands.append("refit")
        c.epoch = c.epoch + 1 if epoch is None else epoch
        c.weights = source
        engines = {f"engine-{g}": {"group": g, "epoch": c.epoch, "total_s": 0.5} for g in c.groups()}
        return {"state": c.state, "detail": {"epoch": c.epoch, "source": source, "engines": engines}}

    async def command(self, verb: str, timeout: float, drain_timeout: float | None = None,
                      pause_mode: str | None = None, keep_kv: bool = False) -> dict[str, Any]:
        from megatron_operator.coordinator_link import CoordinatorRejected

        from megatron_serve.wire.lifecycle import IllegalTransition, next_state, parse_pause_mode

        self._check()
        c = self.coordinator
        try:
            state = next_state(c.state, verb).value
            mode = parse_pause_mode(pause_mode).value if verb == "pause" else None
        except (IllegalTransition, ValueError) as exc:
            raise CoordinatorRejected(f"{verb.upper()} rejected: {exc}") from None
        c.commands.append(verb)
        if verb == "suspend":
            c.suspend_keep_kv.append(keep_kv)
        detail: dict[str, Any] = {"engines": len(c.groups())}
        if mode is not None:
            c.pause_modes.append(mode)
            c.pause_drains.append(drain_timeout)
            detail["mode"] = mode
        c.state = state
        return {"state": c.state, "detail": detail}

    async def close(self) -> None:
        pass


# --------------------------------------------------------------------------- the cluster

class Cluster:
    """The emulator + HTTP helpers + fake controllers + (optionally) the operator."""

    def __init__(self, emu: Any, url: str, kubeconfig: pathlib.Path):
        self.emu = emu
        self.url = url
        self.kubeconfig = kubeconfig
        self.hold: set[str] = set()  # workloads the fake controllers must not mark ready
        self._controllers: asyncio.Task[None] | None = None
        self._operator: threading.Thread | None = None
        self._stop: threading.Event | None = None
        self._failure: list[BaseException] = []
        self.coordinator: FakeCoordinator | None = None

    # -- raw API
    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = "application/json") -> tuple[int, Any]:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            async with session.request(method, self.url + path, json=body,
                                       headers={"Content-Type": content_type}) as resp:
                text = await resp.text()
                try:
                    return resp.status, (await resp.json(content_type=None)) if text else None
                except ValueError:
                    return resp.status, text

    async def must(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                   expect: tuple[int, ...] = (200, 201)) -> Any:
        code, data = await self.request(method, path, body, content_type)
        assert code in expect, f"{method} {path} -> {code}: {data}"
        return data

    async def install_crd(self) -> None:
        (crd,) = load_yaml(CRD_PATH)
        await self.must("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)

    @staticmethod
    def mi_path(namespace: str, name: str | None = None, sub: str | None = None) -> str:
        path = f"/apis/serving.megatron.dev/v1alpha1/namespaces/{namespace}/megatroninferences"
        if name:
            path += f"/{name}"
        if sub:
            path += f"/{sub}"
        return path

    async def apply(self, resource: dict[str, Any]) -> dict[str, Any]:
        ns = resource["metadata"].setdefault("namespace", "default")
        return await self.must("POST", self.mi_path(ns), resource)

    async def patch_mi(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return await self.must("PATCH", self.mi_path(namespace, name), patch, "application/merge-patch+json")

    def mi(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.emu.find("megatroninferences", namespace, name)

    def status(self, namespace: str, name: str) -> dict[str, Any]:
        return (self.mi(namespace, name) or {}).get("status") or {}

    def children(self, namespace: str, instance: str) -> dict[tuple[str, str], dict[str, Any]]:
        out = {}
        for plural in ("secrets", "services", "deployments", "statefulsets", "leaderworkersets", "networkpolicies",
                       "poddisruptionbudgets"):
            for obj in self.emu.objects_of(plural, namespace):
                if (obj["metadata"].get("labels") or {}).get("app.kubernetes.io/instance") == instance:
                    out[(obj["kind"], obj["metadata"]["name"])] = obj
        return out

    def token_of(self, namespace: str, name: str) -> str | None:
        secret = self.emu.find("secrets", namespace, f"{name}-coordinator-token")
        if not secret:
            return None
        return base64.b64decode(secret["data"]["token"]).decode()

    def ready_groups(self, namespace: str, instance: str) -> list[int]:
        groups = []
        for sts in self.emu.objects_of("statefulsets", namespace):
            labels = sts["metadata"].get("labels") or {}
            if labels.get("app.kubernetes.io/instance") != instance:
                continue
            status = sts.get("status") or {}
            if sts["spec"].get("replicas", 0) > 0 and status.get("readyReplicas", 0) >= sts["spec"]["replicas"]:
                groups.append(int(labels["serving.megatron.dev/group"]))
        return sorted(groups)

    # -- fake workload controllers
    async def _controller_loop(self) -> None:
        emu = self.emu
        seen = -1
        while True:
            # react to changes; also re-check now and then (tests release held workloads)
            await emu.wait_until(lambda: emu.rv != seen, 0.2)
            seen = emu.rv
            for plural in ("deployments", "statefulsets"):
                for obj in emu.objects_of(plural):
                    name = obj["metadata"]["name"]
                    if name in self.hold:
                        continue
                    replicas = int(obj["spec"].get("replicas", 1))
                    want = {"observedGeneration": obj["metadata"]["generation"], "replicas": replicas,
                            "readyReplicas": replicas, "updatedReplicas": replicas,
                            "availableReplicas": replicas}
                    status = obj.get("status") or {}
                    if any(status.get(k) != v for k, v in want.items()):
                        await emu.set_status(plural, obj["metadata"]["namespace"], name, want)
            seen = emu.rv

    def start_controllers(self) -> None:
        self._controllers = asyncio.create_task(self._controller_loop())

    # -- the operator (kopf in its own thread and event loop, as in production: kopf cancels
    #    every task of its loop on exit, which must not include the test's own tasks)
    async def start_operator(self, coordinator: FakeCoordinator | None = None) -> None:
        import kopf

        from megatron_operator import coordinator_link, handlers

        handlers.set_kube(None)  # re-read KUBECONFIG (this test's emulator)
        if coordinator is not None:
            self.coordinator = coordinator
            coordinator_link.set_link_factory(coordinator.open)
        self._stop = threading.Event()
        ready = threading.Event()
        self._failure: list[BaseException] = []

        def main() -> None:
            loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(kopf.operator(
                    registry=kopf.get_default_registry(), standalone=True, clusterwide=True,
                    stop_flag=self._stop, ready_flag=ready))
            except BaseException as exc:  # reported by stop_operator()
                self._failure.append(exc)
            finally:
                loop.close()

        self._operator = threading.Thread(target=main, name="kopf-operator", daemon=True)
        self._operator.start()
        await wait_for(lambda: ready.is_set() or self._failure, timeout=30, what="kopf startup")
        assert not self._failure, f"kopf failed to start: {self._failure!r}"

    async def stop_operator(self) -> None:
        if self._operator is None:
            return
        assert self._stop is not None
        self._stop.set()
        thread = self._operator
        await wait_for(lambda: not thread.is_alive(), timeout=30, what="kopf shutdown")
        self._operator = None
        failures = [f for f in self._failure if not isinstance(f, asyncio.CancelledError)]
        assert not failures, f"kopf failed: {failures!r}"

    async def close(self) -> None:
        from megatron_operator import coordinator_link, handlers

        try:
            await self.stop_operator()
        finally:  # the next test's operator must not find this one's link factory or client
            if self._controllers is not None:
                self._controllers.cancel()
                await asyncio.gather(self._controllers, return_exceptions=True)
            coordinator_link.set_link_factory(None)
            handlers.set_kube(None)


def fake_coordinator_for(c: Cluster, namespace: str, name: str) -> FakeCoordinator:
    return FakeCoordinator(groups=lambda: c.ready_groups(namespace, name),
                           token=lambda: c.token_of(namespace, name))


def with_uid(resource: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(resource)
    out["metadata"] = dict(out["metadata"], uid=live["metadata"]["uid"], namespace=live["metadata"]["namespace"])
    return out
