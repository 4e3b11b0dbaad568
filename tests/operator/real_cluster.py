"""A real Kubernetes cluster for the operator's tests: one per run, a namespace per test.

Fixtures (import them into a conftest or test module: ``from .real_cluster import kube, kube_namespace``):

``kube`` (session) -> :class:`KubeCluster`
    Which cluster, in this order:

    1. ``MEGATRON_KUBE_CLUSTER_DIR``: a folder that ``tools/kube-cluster up DIR`` made (``make test`` brings one up
       around pytest and exports it with ``KUBECONFIG``; ``source DIR/env`` exports it too). ``restart`` works.
    2. ``MEGATRON_KUBECONFIG``: any other cluster's kubeconfig (kind, a cloud cluster). Tests that need this
       project's fake GPU nodes or a component restart skip there, saying so.
    3. Otherwise the fixture starts one with ``tools/kube-cluster up`` in a folder under the temporary directory,
       shared by the run's pytest-xdist workers (a file lock and a count of users: the first starts it, the last
       stops it and removes its folder).

    ``KUBECONFIG`` alone is not read: the emulator suites point it at their own emulator while they import.

``kube_namespace`` (function) -> :class:`Namespace`
    A fresh namespace named after the test (``.name``, ``.kubeconfig``, ``.cluster``). Afterwards its workloads and
    pods are deleted, and the namespace too (without waiting: the namespace controller finishes in the background)
    unless the cluster is discarded with the run (the fixture's own, or ``make test``'s with
    ``--kube-cluster-down-when-unused``). Made and deleted in-process with the admin's client
    (:meth:`KubeCluster.admin`): no test is about a namespace's own making, and a ``kubectl`` process for each was two
    Go processes a test (docs/testing.md).

A :class:`KubeCluster` gives ``kubeconfig`` (the admin's), ``kubectl(...)``/``helm(...)`` (the cluster's own binaries
when ``tools/kube-cluster`` made it, else those on PATH), ``api_client()`` (the official ``kubernetes`` client),
``admin()`` (the process's one such client, kept open) and ``restart(component)``.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import filelock
import kubernetes
import pytest

from .cluster_users import OPTION

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "kube-cluster"
#: What ``tools/kube-cluster`` stamps into its binaries (tools/kube-cluster.d/kube_cluster/components.py).
KUBERNETES_VERSION = "v1.37.2"


#: Each cluster's admin client in this process (:meth:`KubeCluster.admin`), by kubeconfig.
_ADMIN: dict[str, kubernetes.client.ApiClient] = {}
_ADMIN_LOCK = threading.Lock()


@dataclass(frozen=True)
class KubeCluster:
    """A cluster the tests may use: its admin kubeconfig, and its folder when ``tools/kube-cluster`` made it."""

    kubeconfig: pathlib.Path
    directory: pathlib.Path | None = None

    @property
    def ours(self) -> bool:
        """True for a cluster of ``tools/kube-cluster`` (fake GPU nodes, restartable components)."""
        return self.directory is not None

    def binary(self, name: str) -> str:
        if self.directory is not None and (self.directory / "bin" / name).exists():
            return str(self.directory / "bin" / name)
        found = shutil.which(name)
        if found is None:
            raise AssertionError(f"{name} is not on PATH and {self.kubeconfig} is not a tools/kube-cluster cluster")
        return found

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run this cluster's kubectl as the admin; a failure with ``check`` raises with kubectl's own message."""
        done = subprocess.run([self.binary("kubectl"), f"--kubeconfig={self.kubeconfig}", *args], input=input,
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([self.binary("helm"), f"--kubeconfig={self.kubeconfig}", *args],
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def api_client(self) -> kubernetes.client.ApiClient:
        """A client of the official ``kubernetes`` package as the admin (a new one each call: close it)."""
        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=configuration)
        return kubernetes.client.ApiClient(configuration)

    def admin(self) -> kubernetes.client.ApiClient:
        """The process's one admin client of this cluster (kept open: its connections are reused by the fixtures'
        set-up and clean-up, which would otherwise each pay a TLS handshake)."""
        with _ADMIN_LOCK:
            client = _ADMIN.get(str(self.kubeconfig))
            if client is None:
                client = _ADMIN[str(self.kubeconfig)] = self.api_client()
            return client

    def restart(self, component: str) -> None:
        """Restart one component with its arguments (``kube-apiserver`` waits for /readyz; etcd's data is kept)."""
        if self.directory is None:
            pytest.skip(f"restarting {component} needs a tools/kube-cluster cluster; {self.kubeconfig} is another")
        done = subprocess.run([str(TOOL), "restart", str(self.directory), component], capture_output=True, text=True)
        if done.returncode != 0:
            raise AssertionError(f"tools/kube-cluster restart {component} failed: {done.stderr.strip()}")


@dataclass(frozen=True)
class Namespace:
    """One test's namespace on the run's cluster."""

    name: str
    cluster: KubeCluster

    @property
    def kubeconfig(self) -> pathlib.Path:
        return self.cluster.kubeconfig


def _shared_folder() -> pathlib.Path:
    """One folder per pytest run, the same in each of its xdist workers."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    return pathlib.Path(tempfile.gettempdir()) / f"megatron-kube-{run}"


def _users(folder: pathlib.Path, change: int) -> int:
    count_file = folder / "users"
    count = int(count_file.read_text()) if count_file.exists() else 0
    count += change
    count_file.write_text(f"{count}\n")
    return count


def _tool(verb: str, folder: pathlib.Path) -> None:
    done = subprocess.run([str(TOOL), verb, str(folder / "cluster")], capture_output=True, text=True)
    if done.returncode != 0:
        raise AssertionError(f"tools/kube-cluster {verb} {folder / 'cluster'} failed:\n{done.stderr[-4000:]}")


@pytest.fixture(scope="session")
def kube() -> Iterator[KubeCluster]:
    """The run's cluster (see the module's docstring for which)."""
    directory = os.environ.get("MEGATRON_KUBE_CLUSTER_DIR")
    if directory:
        path = pathlib.Path(directory)
        if not (path / "kubeconfig").is_file():
            raise AssertionError(f"MEGATRON_KUBE_CLUSTER_DIR={directory} holds no kubeconfig (tools/kube-cluster up?)")
        yield KubeCluster(path / "kubeconfig", path)
        return
    external = os.environ.get("MEGATRON_KUBECONFIG")
    if external:
        if not pathlib.Path(external).is_file():
            raise AssertionError(f"MEGATRON_KUBECONFIG={external} is not a file")
        yield KubeCluster(pathlib.Path(external))
        return
    shared = _shared_folder()
    shared.mkdir(exist_ok=True)
    lock = filelock.FileLock(str(shared / "lock"))
    with lock:
        if _users(shared, +1) == 1 or not (shared / "cluster" / "kube-apiserver.pid").exists():
            _tool("up", shared)
    try:
        yield KubeCluster(shared / "cluster" / "kubeconfig", shared / "cluster")
    finally:
        with lock:
            if _users(shared, -1) == 0:
                _tool("down", shared)
                shutil.rmtree(shared / "cluster")  # the fixture's own folder (etcd's data, logs): nothing to keep


def _namespace_name(test_name: str) -> str:
    """A DNS-1123 label from the test's name and a random suffix (namespaces outlive a test briefly)."""
    base = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:48].rstrip("-")
    return f"{base}-{uuid.uuid4().hex[:6]}"


def discarded_after_the_run(kube: KubeCluster, config: pytest.Config) -> bool:
    """True when the cluster goes away with this run: the one the ``kube`` fixture started itself, or the one
    ``--kube-cluster-down-when-unused`` (``make test``) stops once its tests are done."""
    if kube.directory is None:
        return False
    down_when_unused = config.getoption(OPTION, default=None)
    return kube.directory.resolve() in {(_shared_folder() / "cluster").resolve(),
                                        *([pathlib.Path(down_when_unused).resolve()] if down_when_unused else [])}


def _stop_what_runs(api: kubernetes.client.ApiClient, namespace: str) -> None:
    """Delete the namespace's workloads and pods (LeaderWorkerSets where the cluster serves them, HPAs): nothing of
    the test's keeps a controller busy or holds a node's GPUs once it is over, whether the namespace goes or not."""
    apps, core = kubernetes.client.AppsV1Api(api), kubernetes.client.CoreV1Api(api)
    for collection in (apps.delete_collection_namespaced_stateful_set, apps.delete_collection_namespaced_deployment,
                       apps.delete_collection_namespaced_replica_set, core.delete_collection_namespaced_pod,
                       kubernetes.client.AutoscalingV2Api(api).delete_collection_namespaced_horizontal_pod_autoscaler):
        collection(namespace)
    try:
        kubernetes.client.CustomObjectsApi(api).delete_collection_namespaced_custom_object(
            "leaderworkerset.x-k8s.io", "v1", namespace, "leaderworkersets")
    except kubernetes.client.ApiException as error:
        if error.status != 404:  # 404: the cluster serves no LeaderWorkerSets (runs no LWS controller)
            raise


@pytest.fixture
def kube_namespace(kube: KubeCluster, request: pytest.FixtureRequest) -> Iterator[Namespace]:
    """A namespace for this test alone. Afterwards what runs in it is deleted, and the namespace itself too where the
    cluster outlives the run. On a cluster discarded with the run it stays: deleting a namespace has the namespace
    controller list and delete every namespaced kind in it, the most API requests of any one client of the
    real-cluster files (docs/testing.md has the figures), for a cluster that goes down minutes later anyway."""
    name = _namespace_name(request.node.name)
    api = kube.admin()
    core = kubernetes.client.CoreV1Api(api)
    core.create_namespace({"apiVersion": "v1", "kind": "Namespace",
                           "metadata": {"name": name, "labels": {"megatron-serve.test": "true"}}})
    try:
        yield Namespace(name, kube)
    finally:
        _stop_what_runs(api, name)
        if not discarded_after_the_run(kube, request.config):
            try:
                core.delete_namespace(name)  # returns at once: the namespace controller empties it in the background
            except kubernetes.client.ApiException as error:
                if error.status != 404:  # gone already is what a clean-up wants
                    raise
