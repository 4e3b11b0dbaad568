"""`up` and `down`: the control plane as processes in DIR, in the order a kubeadm node starts them.

etcd (TLS, data in DIR/etcd) -> kube-apiserver (TLS, Node+RBAC, ServiceAccount token keys) ->
kube-controller-manager (per-controller ServiceAccount credentials, the root CA and the token
signer) and kube-scheduler -> kwok (the kubelets of the fake nodes) -> the nodes -> the LWS
controller with its CRDs and webhooks. Ports are picked free and kept in DIR/ports.json, so
a later `up` on the same DIR (etcd's data kept) reuses the kubeconfig's address when it can.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from . import components, lws, nodes, pki, processes
from .api import Api

# Stopped in this order by `down` (dependents first); names with a pid file but not listed
# here go first.
ORDER = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "lws-controller")
# kube-controller-manager's controllers (their names less "-controller") that `up` leaves out: Jobs, CronJobs,
# DaemonSets, ReplicationControllers, ResourceQuotas, CSRs, DRA claims, volume attach/expand, ephemeral volumes,
# storage-version upkeep and the node TTL annotation (the fake nodes set it themselves).
UNUSED_CONTROLLERS = (
    "cronjob", "job", "ttl-after-finished", "daemonset", "replicationcontroller", "resourcequota",
    "certificatesigningrequest-approving", "certificatesigningrequest-cleaner", "certificatesigningrequest-signing",
    "podcertificaterequest-cleaner", "kube-apiserver-serving-clustertrustbundle-publisher",
    "legacy-serviceaccount-token-cleaner", "endpointslice-mirroring", "ephemeral-volume",
    "persistentvolume-attach-detach", "persistentvolume-expander", "volumeattributesclass-protection",
    "resourceclaim", "resourcepoolstatusrequest", "device-taint-eviction", "podgroup-protection",
    "storage-version-migrator", "storageversion-garbage-collector", "validatingadmissionpolicy-status", "ttl",
)
PORTS = ("etcd-client", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok",
         "lws-webhook", "lws-health")


def _ports(folder: Path) -> dict[str, int]:
    """Reuse the ports of an earlier `up` of DIR where they are still free; pick the rest."""
    saved_file = folder / "ports.json"
    saved = json.loads(saved_file.read_text()) if saved_file.exists() else {}
    chosen: dict[str, int] = {}
    for name in PORTS:
        port = saved.get(name)
        if port is None or not processes.port_free(port) or port in chosen.values():
            port = processes.free_port()
            while port in chosen.values():
                port = processes.free_port()
        chosen[name] = port
    saved_file.write_text(json.dumps(chosen, indent=1) + "\n")
    return chosen


def _write_kubeconfigs(folder: Path, server: str) -> dict[str, Path]:
    out = folder / "kubeconfigs"
    out.mkdir(exist_ok=True)
    paths = {}
    for identity in pki.IDENTITIES:
        path = out / f"{identity.file}.kubeconfig"
        path.write_text(pki.kubeconfig(folder / "pki", server, identity.file))
        path.chmod(0o600)
        paths[identity.file] = path
    (folder / "kubeconfig").write_text(paths["admin"].read_text())
    (folder / "kubeconfig").chmod(0o600)
    return paths


def _etcd(cache: Path, folder: Path, ports: dict[str, int]) -> list[str]:
    p = folder / "pki"
    client = f"https://127.0.0.1:{ports['etcd-client']}"
    peer = f"https://127.0.0.1:{ports['etcd-peer']}"
    return [
        str(components.BY_NAME["etcd"].binary(cache, "etcd")),
        "--name=default", f"--data-dir={folder / 'etcd'}",
        f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=default={peer}",
        f"--cert-file={p / 'etcd-server.crt'}", f"--key-file={p / 'etcd-server.key'}",
        f"--trusted-ca-file={p / 'ca.crt'}", "--client-cert-auth=true",
        f"--peer-cert-file={p / 'etcd-server.crt'}", f"--peer-key-file={p / 'etcd-server.key'}",
        f"--peer-trusted-ca-file={p / 'ca.crt'}", "--peer-client-cert-auth=true",
        # A test cluster on a shared disk: skip fsync (etcd's own flag for this); data written
        # survives a process restart, not a machine crash.
        "--unsafe-no-fsync=true", "--quota-backend-bytes=2147483648", "--log-level=warn",
    ]


def _apiserver(cache: Path, folder: Path, ports: dict[str, int]) -> list[str]:
    p = folder / "pki"
    return [
        str(components.BY_NAME["kubernetes"].binary(cache, "kube-apiserver")),
        f"--etcd-servers=https://127.0.0.1:{ports['etcd-client']}",
        f"--etcd-cafile={p / 'ca.crt'}", f"--etcd-certfile={p / 'apiserver-etcd-client.crt'}",
        f"--etcd-keyfile={p / 'apiserver-etcd-client.key'}",
        "--bind-address=127.0.0.1", f"--secure-port={ports['apiserver']}",
        f"--cert-dir={p / 'apiserver-generated'}",
        f"--tls-cert-file={p / 'apiserver.crt'}", f"--tls-private-key-file={p / 'apiserver.key'}",
        f"--client-ca-file={p / 'ca.crt'}",
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        "--allow-privileged=true",
        f"--service-cluster-ip-range={pki.SERVICE_CIDR}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={p / 'sa.pub'}",
        f"--service-account-signing-key-file={p / 'sa.key'}",
        "--profiling=false",
        # The plain in-flight limits rather than API Priority and Fairness: its queues, its configuration objects and
        # their controller cost every request and the idle server CPU, and a test cluster has no tenants to keep fair.
        "--enable-priority-and-fairness=false",
        # The aggregation layer's front proxy, so that controllers' delegated authentication finds its CA.
        f"--requestheader-client-ca-file={p / 'ca.crt'}", "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={p / 'front-proxy-client.crt'}",
        f"--proxy-client-key-file={p / 'front-proxy-client.key'}",
    ]


def _component_auth(kubeconfig: Path, port: int) -> list[str]:
    return [f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}", "--bind-address=127.0.0.1",
            f"--secure-port={port}", "--leader-elect=false", "--profiling=false"]


def _controller_manager(cache: Path, folder: Path, ports: dict[str, int], kubeconfig: Path) -> list[str]:
    p = folder / "pki"
    return [
        str(components.BY_NAME["kubernetes"].binary(cache, "kube-controller-manager")),
        *_component_auth(kubeconfig, ports["controller-manager"]),
        f"--cert-dir={p / 'controller-manager-generated'}",
        "--use-service-account-credentials=true",
        f"--root-ca-file={p / 'ca.crt'}",
        f"--service-account-private-key-file={p / 'sa.key'}",
        f"--service-cluster-ip-range={pki.SERVICE_CIDR}",
        # The default controllers but those that nothing on this cluster uses (no test, no chart, no operator
        # creates what they manage; nodes and volumes are kwok's and local): each one left out is informers,
        # workqueues and periodic passes the suite no longer pays for while it runs.
        "--controllers=" + ",".join(("*", *(f"-{name}-controller" for name in UNUSED_CONTROLLERS))),
        # The HPA controller's pass (and its refresh of which metrics APIs exist) every 5 s, not every 15 s: a test
        # cluster's HPA acts in seconds rather than waiting out a production cadence.
        "--horizontal-pod-autoscaler-sync-period=5s",
    ]


def _scheduler(cache: Path, folder: Path, ports: dict[str, int], kubeconfig: Path) -> list[str]:
    return [
        str(components.BY_NAME["kubernetes"].binary(cache, "kube-scheduler")),
        *_component_auth(kubeconfig, ports["scheduler"]),
        f"--cert-dir={folder / 'pki' / 'scheduler-generated'}",
    ]


def _kwok(cache: Path, folder: Path, ports: dict[str, int], kubeconfig: Path) -> list[str]:
    kwok = components.BY_NAME["kwok"]
    stages = sorted((kwok.folder(cache) / "stages").glob("*.yaml"))
    config = folder / "kwok.yaml"
    config.write_text("\n---\n".join(s.read_text() for s in stages))
    return [
        str(kwok.binary(cache, "kwok")),
        f"--kubeconfig={kubeconfig}", f"--config={config}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={nodes.KWOK_ANNOTATION}=fake",
        # Every fake node's address is this machine's loopback, with kwok's server as its kubelet port.
        "--node-ip=127.0.0.1", f"--node-port={ports['kwok']}",
        f"--server-address=127.0.0.1:{ports['kwok']}",
        "--node-lease-duration-seconds=40",
        "--cidr=10.244.0.0/16",
    ]


def _kubectl(cache: Path, folder: Path, *args: str, stdin: str | None = None) -> str:
    kubectl = components.BY_NAME["kubernetes"].binary(cache, "kubectl")
    done = subprocess.run([str(kubectl), f"--kubeconfig={folder / 'kubeconfig'}", *args],
                          input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"kube-cluster: kubectl {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def _write_env(cache: Path, folder: Path) -> None:
    """DIR/bin holds links to this cluster's kubectl and helm; DIR/env puts it first on PATH."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool, component in (("kubectl", "kubernetes"), ("helm", "helm")):
        link = bin_dir / tool
        link.unlink(missing_ok=True)
        link.symlink_to(components.BY_NAME[component].binary(cache, tool))
    (folder / "env").write_text(
        f'export PATH="{bin_dir}:$PATH"\n'
        f'export KUBECONFIG="{folder / "kubeconfig"}"\n'
        f'export MEGATRON_KUBE_CLUSTER_DIR="{folder}"\n'
    )


def up(folder: Path, with_lws: bool = True, apiserver_args: tuple[str, ...] = ()) -> None:
    """Build what is missing, start every component, return once the cluster is usable (``apiserver_args``: more
    kube-apiserver flags, after the cluster's own)."""
    if folder.exists() and not folder.is_dir():
        raise SystemExit(f"kube-cluster: {folder} is not a directory")
    cache = components.cache_root()
    started = time.monotonic()
    built = components.build_all(cache, None if with_lws else
                                 tuple(c.name for c in components.COMPONENTS if c.name != "lws"))
    build_seconds = sum(built.values())
    folder.mkdir(parents=True, exist_ok=True)
    folder = folder.resolve()
    live = [n for n in ORDER if processes.running(folder, n)]
    if live:
        raise SystemExit(f"kube-cluster: {', '.join(live)} already running in {folder}; "
                         f"run `tools/kube-cluster down {folder}` first")
    try:
        _start(cache, folder, with_lws, apiserver_args)
    except BaseException:
        down(folder)  # a failed `up` leaves nothing running; the logs stay for the reader
        raise
    up_seconds = time.monotonic() - started - build_seconds
    print(f"kube-cluster: up in {up_seconds:.1f} s"
          + (f" (after {build_seconds:.0f} s of cold builds: "
             + ", ".join(f"{k} {v:.0f} s" for k, v in built.items() if v) + ")" if build_seconds else "")
          + f"; source {folder / 'env'}", file=sys.stderr)


def _start(cache: Path, folder: Path, with_lws: bool, apiserver_args: tuple[str, ...]) -> None:
    pki.make(folder / "pki")
    ports = _ports(folder)
    server = f"https://127.0.0.1:{ports['apiserver']}"
    kubeconfigs = _write_kubeconfigs(folder, server)
    api = Api(server, folder / "pki")

    processes.start(folder, "etcd", _etcd(cache, folder, ports))
    processes.start(folder, "kube-apiserver", [*_apiserver(cache, folder, ports), *apiserver_args])
    processes.wait("kube-apiserver /readyz", lambda: api.text("/readyz") == "ok", 180,
                   folder / "kube-apiserver.log")
    processes.start(folder, "kube-controller-manager",
                    _controller_manager(cache, folder, ports, kubeconfigs["controller-manager"]))
    processes.start(folder, "kube-scheduler", _scheduler(cache, folder, ports, kubeconfigs["scheduler"]))
    processes.start(folder, "kwok", _kwok(cache, folder, ports, kubeconfigs["kwok"]))
    _kubectl(cache, folder, "apply", "-f", "-", stdin=nodes.manifests_json())
    names = [n.name for n in nodes.NODES]
    processes.wait(f"nodes {', '.join(names)} Ready", lambda: api.ready_nodes(names), 120, folder / "kwok.log")
    processes.wait("the default ServiceAccount and kube-root-ca.crt in namespace default",
                   lambda: api.get("/api/v1/namespaces/default/serviceaccounts/default")
                   and api.get("/api/v1/namespaces/default/configmaps/kube-root-ca.crt"),
                   120, folder / "kube-controller-manager.log")
    if with_lws:
        lws.start(cache, folder, ports, kubeconfigs["lws"], api,
                  lambda *args, stdin=None: _kubectl(cache, folder, *args, stdin=stdin))
    _write_env(cache, folder)


def down(folder: Path) -> None:
    """Stop every process `up` started in DIR (pid files), dependents first; keep every file."""
    folder = folder.resolve()
    if not folder.is_dir():
        print(f"kube-cluster: nothing to stop ({folder} does not exist)", file=sys.stderr)
        return
    names = processes.started_names(folder)
    ordered = [n for n in names if n not in ORDER] + [n for n in reversed(ORDER) if n in names]
    stopped = [n for n in ordered if processes.stop(folder, n)]
    print(f"kube-cluster: stopped {', '.join(stopped) or 'nothing (no live processes)'} in {folder}",
          file=sys.stderr)


def cpu(folder: Path) -> None:
    """Print the CPU seconds each running component has used so far, and their sum: two readings around a test run
    give the control plane's cost of that run (docs/testing.md has the figures)."""
    folder = folder.resolve()
    used = {name: processes.cpu_seconds(folder, name) for name in processes.started_names(folder)} \
        if folder.is_dir() else {}
    used = {name: seconds for name, seconds in used.items() if seconds is not None}
    if not used:
        raise SystemExit(f"kube-cluster: nothing runs in {folder}")
    for name in sorted(used, key=lambda n: ORDER.index(n) if n in ORDER else -1):
        print(f"{name} {used[name]:.2f}")
    print(f"total {sum(used.values()):.2f}")


def restart(folder: Path, name: str) -> None:
    """Restart one component with its first arguments (e.g. the API server, etcd kept)."""
    folder = folder.resolve()
    processes.restart(folder, name)
    if name == "kube-apiserver":
        server = json.loads((folder / "ports.json").read_text())["apiserver"]
        api = Api(f"https://127.0.0.1:{server}", folder / "pki")
        processes.wait("kube-apiserver /readyz", lambda: api.text("/readyz") == "ok", 180,
                       folder / "kube-apiserver.log")
