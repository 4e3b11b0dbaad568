"""``--kube-cluster-down-when-unused`` (tests/operator/cluster_users.py): the real cluster's files run first and the
cluster is stopped once the last of their tests has finished, while the rest of the run goes on.

Each case runs pytest (and pytest-xdist's real controller and workers) in a process of its own over a small tree of
test files laid out as the suite's are, with the plugin loaded by its conftest as ``tests/conftest.py`` loads it.
The "cluster" is a stand-in process started by ``tools/kube-cluster``'s own process code under the name
``kube-apiserver`` (a control plane costs a minute of CPU to start), and the real ``tools/kube-cluster down`` stops
it; tests/operator/test_kube_cluster_tool.py checks ``down`` on a real one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import wait_until

from .cluster_users import OPTION, ROOT, needs_cluster

sys.path.insert(0, str(ROOT / "tools" / "kube-cluster.d"))
from kube_cluster import processes  # noqa: E402

pytestmark = pytest.mark.timeout(180)

CONFTEST = f"""
import importlib.util

spec = importlib.util.spec_from_file_location("cluster_users", {str(ROOT / "tests/operator/cluster_users.py")!r})
cluster_users = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cluster_users)


def pytest_addoption(parser):
    cluster_users.add_option(parser)


def pytest_configure(config):
    cluster_users.register(config)
"""

# A test of the cluster's files: the stand-in must be alive from its start to its end. It sleeps a little so that,
# with two workers, the other file runs beside it.
CLUSTER_TEST = """
import os, pathlib, time

def alive():
    pid = int(pathlib.Path(os.environ["FAKE_CLUSTER"], "kube-apiserver.pid").read_text())
    return pathlib.Path(f"/proc/{{pid}}").exists()

def test_uses_the_cluster_{n}():
    assert alive(), "the cluster is gone while a test of its files runs"
    time.sleep(1.5)
    assert alive(), "the cluster went away under a test of its files"
"""

# A test elsewhere, as the suite's other files: it records whether the stand-in went away within a few seconds.
OTHER_TEST = """
import os, pathlib, time

def test_elsewhere():
    folder = pathlib.Path(os.environ["FAKE_CLUSTER"])
    deadline = time.monotonic() + float(os.environ["WAIT_S"])
    while time.monotonic() < deadline and (folder / "kube-apiserver.pid").exists():
        time.sleep(0.1)
    (folder / "seen-by-the-other-file").write_text("stopped" if not (folder / "kube-apiserver.pid").exists()
                                                   else "running")
"""


def _tree(tmp_path: Path, stray: bool = False) -> Path:
    """A suite of two cluster files and one other (named to sort first), as laid out under tests/."""
    root = tmp_path / "suite"
    (root / "tests" / "operator").mkdir(parents=True)
    (root / "tests" / "a_elsewhere").mkdir()
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "conftest.py").write_text(CONFTEST)
    for n in (1, 2):
        (root / "tests" / "operator" / f"test_real_{n}.py").write_text(CLUSTER_TEST.format(n=n))
    other = OTHER_TEST
    if stray:  # a test outside the cluster's files that requests the cluster's fixture
        other += "\nimport pytest\n\n@pytest.fixture\ndef kube():\n    return None\n\n\ndef test_stray(kube):\n    pass\n"
    (root / "tests" / "a_elsewhere" / "test_other.py").write_text(other)
    return root


def _cluster(tmp_path: Path) -> tuple[Path, int]:
    folder = tmp_path / "cluster"
    folder.mkdir()
    pid = processes.start(folder, "kube-apiserver", ["sleep", "600"])
    return folder, pid


def _pytest(root: Path, folder: Path, *args: str, wait_s: float = 20.0) -> subprocess.CompletedProcess[str]:
    # Only the plugins the case uses (xdist where it asks for workers): the venv's others cost each process seconds.
    env = {**os.environ, "FAKE_CLUSTER": str(folder), "WAIT_S": str(wait_s), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    xdist = ["-p", "xdist"] if "-n" in args else []
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(root),
                           *xdist, *args, str(root / "tests")], cwd=root, env=env, capture_output=True, text=True,
                          timeout=150)


def _stop(folder: Path, pid: int) -> None:
    if processes.running(folder, "kube-apiserver"):
        processes.stop(folder, "kube-apiserver")
    wait_until(lambda: not Path(f"/proc/{pid}").exists() or processes._zombie(pid), 10, "the stand-in to exit")


def test_which_tests_need_the_cluster():
    assert needs_cluster("tests/operator/test_real_hpa.py::test_scale[a-b]")
    assert needs_cluster("tests/operator/test_kube_cluster.py::test_the_server_reports_the_stamped_version")
    assert needs_cluster("tests/operator/test_kube_cluster_tool.py::test_up")
    assert not needs_cluster("tests/operator/test_operator_kmock.py::test_x")
    assert not needs_cluster("tests/server/test_real_things.py::test_x")  # the name alone is not enough
    assert not needs_cluster("tests/operator/sub/test_real_x.py::test_x")


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadfile", "--no-loadscope-reorder"]],
                         ids=["one-process", "xdist"])
def test_the_cluster_stops_once_its_last_test_is_done_and_the_run_goes_on(tmp_path: Path, workers: list[str]):
    root = _tree(tmp_path)
    folder, pid = _cluster(tmp_path)
    try:
        done = _pytest(root, folder, *workers, f"{OPTION}={folder}")
        assert done.returncode == 0, done.stdout + done.stderr
        # The other file saw it stopped: in one process because the cluster's files ran first, with two workers
        # because the stop came while that file waited, beside them.
        assert (folder / "seen-by-the-other-file").read_text() == "stopped", done.stdout
        assert not Path(f"/proc/{pid}").exists() or processes._zombie(pid)
        assert "kube-cluster: no test left needs it" in done.stdout and "stopped kube-apiserver" in done.stdout, \
            done.stdout
    finally:
        _stop(folder, pid)


def test_without_the_option_the_cluster_outlives_the_run(tmp_path: Path):
    """The control: the same tree and waits, and the cluster is still there after the run."""
    root = _tree(tmp_path)
    folder, pid = _cluster(tmp_path)
    try:
        done = _pytest(root, folder, wait_s=3.0)
        assert done.returncode == 0, done.stdout + done.stderr
        assert (folder / "seen-by-the-other-file").read_text() == "running"
        assert processes.running(folder, "kube-apiserver") == pid
    finally:
        _stop(folder, pid)


def test_a_test_of_the_cluster_outside_its_files_errors_naming_the_rule(tmp_path: Path):
    root = _tree(tmp_path, stray=True)
    folder, pid = _cluster(tmp_path)
    try:
        done = _pytest(root, folder, "-n", "2", "--dist", "loadfile", f"{OPTION}={folder}", "-rE", wait_s=0.0)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "3 passed, 1 error" in done.stdout, done.stdout
        assert ("test_other.py::test_stray requests the `kube` fixture outside the real cluster's files"
                in done.stdout), done.stdout
    finally:
        _stop(folder, pid)


def test_a_folder_without_a_cluster_is_refused(tmp_path: Path):
    root = _tree(tmp_path)
    done = _pytest(root, tmp_path, f"{OPTION}={tmp_path}")
    assert done.returncode != 0
    assert f"{OPTION}={tmp_path}: no tools/kube-cluster cluster there" in done.stdout + done.stderr


class _Options:
    """What ``discarded_after_the_run`` reads of a ``pytest.Config``: its ``getoption`` (a stand-in, so that each
    value of the option can be given without a pytest run of its own)."""

    def __init__(self, value: Path | None) -> None:
        self.value = value

    def getoption(self, name: str, default: object = None) -> object:
        assert name == OPTION, name
        return self.value


def test_a_tests_namespace_is_left_only_on_a_cluster_discarded_with_the_run(tmp_path: Path):
    """kube_namespace deletes a test's namespace unless the cluster goes away with the run: the one ``make test``
    stops through the option, or the one the ``kube`` fixture started itself (the control: any other cluster)."""
    from .real_cluster import KubeCluster, _shared_folder, discarded_after_the_run

    ours = KubeCluster(tmp_path / "kube" / "kubeconfig", tmp_path / "kube")
    assert discarded_after_the_run(ours, _Options(tmp_path / "kube"))
    assert discarded_after_the_run(ours, _Options(tmp_path / "other" / ".." / "kube"))  # the same folder
    assert not discarded_after_the_run(ours, _Options(None))  # a developer's `tools/kube-cluster up` outlives runs
    assert not discarded_after_the_run(ours, _Options(tmp_path / "other"))
    assert not discarded_after_the_run(KubeCluster(tmp_path / "kind.kubeconfig"), _Options(tmp_path / "kube"))
    fixtures_own = KubeCluster(_shared_folder() / "cluster" / "kubeconfig", _shared_folder() / "cluster")
    assert discarded_after_the_run(fixtures_own, _Options(None))
