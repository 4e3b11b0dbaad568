"""The kubelet's part for one resource's engine pods on the real cluster, played by the test.

The pods run under kwok, which runs nothing and marks a new pod Ready the moment it runs, or on the test's own nodes
that kwok does not play (``Fleet.gpu_pool(kubelet=True)``, :mod:`.real_node`). :class:`Kubelet` does what a kubelet
with the rendered pod would do: it starts an engine process (``--group`` of the pod) for each Running engine
pod, keeps the pod not Ready until that engine (by its pid) is registered with the coordinator and not draining (the
engine pods' readiness probe's meaning), and sends the engine SIGTERM when its pod goes (the engine drains: it finishes
or hands back its requests, which continue elsewhere from their tokens). On the test's own nodes it also does what
kwok does elsewhere: it marks a pod bound there Running (not Ready), and deletes a pod that is going once its engine
has exited (SIGKILL past the pod's grace period), which is what lets a StatefulSet make its replacement; nothing
there marks a pod Ready before its engine serves.

One thread (an asyncio loop) owns every decision: it lists the pods through the API, asks the coordinator's STATUS
through the project's client, starts and stops engines and writes readiness. A second thread watches the pods only to
turn kwok's instant Ready back to not Ready within a watch event's latency (the disruption controller and the
operator count a Ready pod at once) and to wake the first; the two share a lock, so a pod the first made Ready is
never turned back (on the test's own nodes nothing else makes a pod Ready). A kubelet that has failed (its API calls
failing for ``patience`` seconds, an engine that exited while its pod still runs, a thread that died) says so through
:meth:`Kubelet.check`, which the tests' waits call: a wait then fails with that reason instead of waiting for a pod
that nothing will make Ready.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time
from typing import Any

import kubernetes

from megatron_operator import names
from megatron_serve.client.coordinator_client import InferenceClient
from tests.helpers import Children

from .real_fleet import Fleet

#: Seconds one API call or watch read may take before it counts as failed (the API server of a loaded host answers
#: in milliseconds to a second; a connection the server dropped without a word would otherwise block for good).
API_TIMEOUT = 15.0
#: Seconds a STATUS may take.
STATUS_TIMEOUT = 5.0


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions", []))


def running(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running" and "deletionTimestamp" not in pod["metadata"]


class Kubelet:
    """Engine processes for the engine pods of resource ``name`` (see the module)."""

    def __init__(self, fleet: Fleet, children: Children, model: str, port: int, env: dict[str, str], *,
                 name: str = "tiny", patience: float = 60.0, poll: float = 0.2):
        """Engines of ``model`` for the coordinator on 127.0.0.1:``port``, with ``env`` (its token in
        ``MEGATRON_SERVE_TOKEN``, which this kubelet's STATUS client uses too)."""
        self.fleet, self.children, self.name, self.model, self.port, self.env = fleet, children, name, model, port, env
        self.patience, self.poll = patience, poll
        self.namespace = fleet.kubectl.namespace
        self.api = kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(
            config_file=str(fleet.kubectl.kubeconfig)))
        self.pods: list[dict[str, Any]] = []  # the last listing of the engine pods
        self.engines: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}  # pod uid -> (group, its engine)
        self.told: set[str] = set()  # pod uids whose engine got SIGTERM (the pod went)
        self.registered: set[int] = set()  # groups with a serving (registered, not draining) engine
        self.failure: str | None = None
        self.lock = threading.Lock()  # the watcher's not-Ready and the loop's Ready never cross
        self.made_ready: set[str] = set()  # pod uids this kubelet made Ready
        #: (monotonic time, "ready" or "going", group, pod uid): when this kubelet made a pod Ready, and when it first
        #: saw an engine pod going (evicted or deleted) and sent its engine SIGTERM
        self.timeline: list[tuple[float, str, int, str]] = []
        self.told_at: dict[str, float] = {}
        self.addresses: dict[str, str] = {}  # pod uid -> its IP, for pods on the test's own nodes
        self.stopping = threading.Event()
        self.wake = threading.Event()
        self.threads = [threading.Thread(target=self._guarded, args=(self._loop,), name="kubelet", daemon=True),
                        threading.Thread(target=self._guarded, args=(self._watch,), name="kubelet-watch",
                                         daemon=True)]

    # ------------------------------------------------------------------ what the tests call

    def start(self) -> "Kubelet":
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        for thread in self.threads:
            thread.join(timeout=API_TIMEOUT + 5)
        self.api.api_client.close()

    def check(self) -> None:
        """Raise with the reason if this kubelet can no longer do its part."""
        if self.failure is not None:
            raise AssertionError(f"the kubelet stand-in failed: {self.failure}")
        if self.fleet.leases is not None:
            self.fleet.leases.check()
        dead = [t.name for t in self.threads if not t.is_alive()]
        if dead and not self.stopping.is_set():
            raise AssertionError(f"the kubelet stand-in's thread {dead} ended; {self.describe()}")

    def serving(self, groups: int) -> bool:
        """All ``groups`` engine pods Running and Ready, each with its own engine serving, and no other pod."""
        pods = self.pods
        return (len(pods) == groups and all(running(p) and pod_ready(p) for p in pods)
                and self.registered == set(range(groups)))

    def describe(self) -> str:
        """The pods, the engines and what the coordinator serves, for a wait's failure message."""
        pods = ", ".join(f"{p['metadata']['name']} ({p['metadata']['uid'][:6]}) {p['status'].get('phase')}"
                         f"{' Ready' if pod_ready(p) else ''}{'' if running(p) else ' (not running)'}"
                         for p in self.pods) or "none"
        engines = ", ".join(f"group {group} pid {process.pid} "
                            f"{'running' if process.poll() is None else f'exited {process.returncode}'}"
                            f"{' (SIGTERM sent)' if uid in self.told else ''}"
                            for uid, (group, process) in self.engines.items()) or "none"
        return f"engine pods: {pods}; engines: {engines}; groups serving: {sorted(self.registered)}"

    # ------------------------------------------------------------------ the threads

    def _guarded(self, body: Any) -> None:
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - a thread's end is reported by check(), not lost
            self.failure = self.failure or f"{type(exc).__name__}: {exc}"
            raise

    def _loop(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        client = InferenceClient(f"tcp://127.0.0.1:{self.port}", token=self.env["MEGATRON_SERVE_TOKEN"],
                                 role="control")
        await client.start(timeout=60)
        ok = time.monotonic()
        last_error = ""
        try:
            while not self.stopping.is_set():
                try:
                    await self._tick(client)
                    ok = time.monotonic()
                except (kubernetes.client.ApiException, OSError, TimeoutError, ConnectionError) as exc:
                    last_error = f"{type(exc).__name__}: {exc}"  # a loaded API server or coordinator: again
                    if time.monotonic() - ok > self.patience:
                        self.failure = f"no pass succeeded for {self.patience:g}s; the last error: {last_error}"
                        return
                await asyncio.to_thread(self.wake.wait, self.poll)
                self.wake.clear()
        finally:
            client.close()

    async def _tick(self, client: InferenceClient) -> None:
        listing = await asyncio.to_thread(self.api.list_namespaced_pod, self.namespace,
                                          label_selector=names.engine_pod_selector(self.name),
                                          _request_timeout=API_TIMEOUT)
        pods = self.api.api_client.sanitize_for_serialization(listing)["items"]
        status = await client.status(timeout=STATUS_TIMEOUT)
        serving = {int(e["info"]["pid"]): int(e["group"]) for e in status["engines"]
                   if e.get("state") != "DRAINING" and isinstance((e.get("info") or {}).get("pid"), int)}
        own = self.fleet.own_nodes
        for pod in pods:
            uid = pod["metadata"]["uid"]
            if (pod["spec"].get("nodeName") in own and (pod.get("status") or {}).get("phase") == "Pending"
                    and "deletionTimestamp" not in pod["metadata"]):
                count = len(self.addresses) + 1
                ip = self.addresses.setdefault(uid, f"10.250.{count // 250}.{count % 250 + 1}")
                await asyncio.to_thread(start_pod, self.api, pod, ip)
                continue  # its engine starts on the next pass, once the listing says Running
            if not running(pod):
                continue
            if uid not in self.engines:
                self.engines[uid] = self._start(pod)
            group, process = self.engines[uid]
            if process.poll() is not None:
                log = self.children.log_of(process)[-2000:]
                self.failure = (f"the engine of pod {pod['metadata']['name']} (group {group}) exited with "
                                f"{process.returncode} while its pod runs:\n{log}")
                return
            mine = serving.get(process.pid) == group  # its own engine serves, not the one of the pod it replaced
            if mine != pod_ready(pod) and (mine or uid not in self.made_ready):
                with self.lock:
                    if mine:
                        self.made_ready.add(uid)
                    await asyncio.to_thread(self._set_ready, pod, mine)
                    if mine:
                        self.timeline.append((time.monotonic(), "ready", group, uid))
        listed = {p["metadata"]["uid"]: p for p in pods}
        for uid, (group, process) in self.engines.items():
            pod = listed.get(uid)
            if uid not in self.told and (pod is None or "deletionTimestamp" in pod["metadata"]):
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)  # the kubelet's SIGTERM: the engine drains
                self.told.add(uid)
                self.told_at[uid] = time.monotonic()
                self.timeline.append((time.monotonic(), "going", group, uid))
        for pod in pods:
            if pod["spec"].get("nodeName") in own and "deletionTimestamp" in pod["metadata"]:
                await asyncio.to_thread(self._finish, pod)
        self.pods = pods
        ours = {process.pid for uid, (_, process) in self.engines.items() if uid not in self.told}
        self.registered = {group for pid, group in serving.items() if pid in ours}

    def _start(self, pod: dict[str, Any]) -> tuple[int, subprocess.Popen[bytes]]:
        group = int(pod["metadata"]["labels"]["serving.megatron.dev/group"])
        return group, self.children.engine(self.model, self.port, "--group", str(group), "--device", "cpu",
                                           "--dtype", "float32", "--drain-timeout", "5", env=self.env)

    def _watch(self) -> None:
        """Turns kwok's Ready back to not Ready within the watch's latency, and wakes the loop on every change."""
        ok = time.monotonic()
        while not self.stopping.is_set():
            try:
                stream = kubernetes.watch.Watch().stream(
                    self.api.list_namespaced_pod, self.namespace, label_selector=names.engine_pod_selector(self.name),
                    timeout_seconds=5, _request_timeout=API_TIMEOUT)
                for event in stream:
                    pod = self.api.api_client.sanitize_for_serialization(event["object"])
                    if running(pod) and pod_ready(pod):
                        with self.lock:
                            if pod["metadata"]["uid"] not in self.made_ready:
                                self._set_ready(pod, False)
                    self.wake.set()
                    if self.stopping.is_set():
                        break
                ok = time.monotonic()
            except (kubernetes.client.ApiException, OSError, TimeoutError, ConnectionError) as exc:
                # urllib3's read timeouts and protocol errors are OSErrors; a 410 (the watch's resource version
                # expired) is an ApiException: both mean start the watch again
                if time.monotonic() - ok > self.patience:
                    self.failure = f"the pod watch failed for {self.patience:g}s: {type(exc).__name__}: {exc}"
                    return
                self.stopping.wait(0.5)

    def _set_ready(self, pod: dict[str, Any], ready: bool) -> None:
        set_ready(self.api, pod, ready)

    def _finish(self, pod: dict[str, Any]) -> None:
        """A going pod on the test's own nodes: deleted for good once its engine exited; its engine killed past the
        pod's grace period, as a kubelet kills a container that outlives it."""
        uid = pod["metadata"]["uid"]
        engine = self.engines.get(uid)
        if engine is not None and engine[1].poll() is None:
            grace = pod["metadata"].get("deletionGracePeriodSeconds") or 0
            if time.monotonic() - self.told_at.get(uid, time.monotonic()) > grace:
                engine[1].kill()
            return
        try:
            self.api.delete_namespaced_pod(pod["metadata"]["name"], pod["metadata"]["namespace"],
                                           body={"gracePeriodSeconds": 0, "preconditions": {"uid": uid}},
                                           _request_timeout=API_TIMEOUT)
        except kubernetes.client.ApiException as exc:
            if exc.status not in (404, 409):  # gone already, or a replacement of the same name
                raise


def start_pod(api: kubernetes.client.CoreV1Api, pod: dict[str, Any], ip: str) -> None:
    """A pod bound to one of the test's own nodes, Running and not Ready: the status a kubelet writes once it started
    the pod's containers (their readiness comes from the engine, :func:`set_ready`)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    conditions = [{"type": kind, "status": "True" if kind not in ("Ready", "ContainersReady") else "False",
                   "lastTransitionTime": now}
                  for kind in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled")]
    containers = [{"name": c["name"], "image": c["image"], "imageID": "", "ready": False, "started": True,
                   "restartCount": 0, "state": {"running": {"startedAt": now}}} for c in pod["spec"]["containers"]]
    body = {"metadata": {"uid": pod["metadata"]["uid"]},
            "status": {"phase": "Running", "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}], "podIP": ip,
                       "podIPs": [{"ip": ip}], "startTime": now, "conditions": conditions,
                       "containerStatuses": containers}}
    _write_status(api, pod, body)


def set_ready(api: kubernetes.client.CoreV1Api, pod: dict[str, Any], ready: bool) -> None:
    """Write a pod's Ready (and ContainersReady) condition, as the kubelet does from its readiness probe."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    conditions = [{**c, "status": "True" if ready else "False", "lastTransitionTime": now}
                  if c["type"] in ("Ready", "ContainersReady") else c for c in pod["status"].get("conditions", [])]
    # the uid is the patch's precondition: a StatefulSet's replacement pod has the same name
    body = {"metadata": {"uid": pod["metadata"]["uid"]}, "status": {"conditions": conditions}}
    _write_status(api, pod, body)


def _write_status(api: kubernetes.client.CoreV1Api, pod: dict[str, Any], body: dict[str, Any]) -> None:
    """Patch a pod's status as the kubelet does; a pod gone (or replaced: the body's uid is a precondition) meanwhile
    needs nothing."""
    try:
        api.patch_namespaced_pod_status(pod["metadata"]["name"], pod["metadata"]["namespace"], body,
                                        _request_timeout=API_TIMEOUT)
    except kubernetes.client.ApiException as exc:
        if exc.status not in (404, 409):
            raise
