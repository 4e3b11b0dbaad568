"""``tools/kube-cluster`` itself: a cluster of this test's own (the run's shared one must not restart under other
tests), its files, an API-server restart and a ``down``/``up`` that keep etcd's data, and ``down`` leaving no process.

The binaries come from the cache that ``make kube-tools`` fills; on a cold cache the first ``up`` builds them.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

from .real_cluster import KUBERNETES_VERSION, TOOL, KubeCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(TOOL), *args], capture_output=True, text=True, timeout=540)


def live_pids(folder: pathlib.Path) -> list[int]:
    """Processes whose command line runs a binary from this cluster's cache or names this folder."""
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(folder) in cmdline:
                found.append(int(proc.name))
    return found


def test_up_restart_down_up_keeps_the_data_and_down_stops_everything(tmp_path: pathlib.Path):
    """One cluster for the whole life of a DIR (each ``up`` costs some 8 CPU-seconds, the API server's start): a
    second ``up`` while it runs is refused naming what runs, and leaves it running."""
    folder = tmp_path / "cluster"
    started = tool("up", str(folder), "--without-lws")
    assert started.returncode == 0, started.stderr
    try:
        second = tool("up", str(folder), "--without-lws")
        assert second.returncode != 0
        assert "already running" in second.stderr and "kube-apiserver" in second.stderr

        cluster = KubeCluster(folder / "kubeconfig", folder)
        env = dict(line.removeprefix("export ").split("=", 1) for line in (folder / "env").read_text().splitlines())
        assert env["KUBECONFIG"].strip('"') == str(folder / "kubeconfig")
        assert env["PATH"].strip('"').split(":")[0] == str(folder / "bin")
        ports = json.loads((folder / "ports.json").read_text())
        assert len(set(ports.values())) == len(ports), ports  # each picked free, none twice
        assert f"https://127.0.0.1:{ports['apiserver']}" in (folder / "kubeconfig").read_text()
        for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"):
            assert (folder / f"{name}.log").stat().st_size > 0, name
            assert int((folder / f"{name}.pid").read_text()) in live_pids(folder), name
        used = dict(line.split() for line in tool("cpu", str(folder)).stdout.splitlines())
        assert list(used) == ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "total"]
        assert all(float(seconds) > 0 for seconds in used.values()), used

        cluster.kubectl("create", "configmap", "kept", "--from-literal=answer=42")
        restarted = tool("restart", str(folder), "kube-apiserver")
        assert restarted.returncode == 0, restarted.stderr
        assert cluster.kubectl("get", "configmap", "kept", "-o", "jsonpath={.data.answer}").stdout == "42"

        stopped = tool("down", str(folder))
        assert stopped.returncode == 0, stopped.stderr
        assert live_pids(folder) == []
        assert (folder / "etcd").is_dir() and (folder / "kubeconfig").is_file()  # down removes nothing

        again = tool("up", str(folder), "--without-lws")
        assert again.returncode == 0, again.stderr
        assert cluster.kubectl("get", "configmap", "kept", "-o", "jsonpath={.data.answer}").stdout == "42"
        assert f"Server Version: {KUBERNETES_VERSION}" in cluster.kubectl("version").stdout
    finally:
        tool("down", str(folder))
    assert live_pids(folder) == []


@pytest.mark.parametrize("argv, message", [
    (["build", "kubelet"], "unknown component(s) kubelet"),
    (["restart", "{dir}", "kubelet"], "invalid choice: 'kubelet'"),
    (["up", "{file}"], "is not a directory"),
    (["up", "{dir}/cluster", "--apiserver-arg=watch-cache=false"], "--apiserver-arg takes kube-apiserver flags"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["cpu", "{dir}"], "nothing runs in"),
])
def test_bad_input_is_refused_naming_it(tmp_path: pathlib.Path, argv: list[str], message: str):
    file = tmp_path / "a-file"
    file.write_text("")
    done = tool(*(a.format(dir=tmp_path, file=file) for a in argv))
    assert done.returncode != 0
    assert message in done.stderr, done.stderr
    assert os.listdir(tmp_path) == ["a-file"]
