"""Stop the run's control plane once no test left in the run needs it (``--kube-cluster-down-when-unused=DIR``).

``make test`` brings one ``tools/kube-cluster`` control plane up for the whole run; idle, it still burns CPU
(leases, resyncs, watch bookmarks) that the rest of the suite, CPU-bound on a small machine, could use. With the
option, the files that need the cluster run first, and once the last of their tests has finished (its teardown
reported, module fixtures included), the process that sees every report (pytest-xdist's controller, or pytest itself
without workers) runs ``tools/kube-cluster down DIR`` in the background. The Makefile's own ``down`` after pytest
still runs, and finds nothing left to stop.

Which tests need it is decided from node ids alone, since the xdist controller never collects: the files
:func:`needs_cluster` names. Every process that collects also looks for other tests that request the ``kube``
fixture: such a test errors, naming the rule, rather than finding the cluster gone.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "kube-cluster"
OPTION = "--kube-cluster-down-when-unused"
#: The fixture every test of the shared cluster requests, directly or through ``kube_namespace``.
FIXTURE = "kube"
#: Seconds the summary waits for a ``down`` still running when the run ends.
DOWN_TIMEOUT_S = 60.0


def needs_cluster(nodeid: str) -> bool:
    """True for a test in a file of the real cluster's: ``tests/operator/test_real_*.py`` and
    ``tests/operator/test_kube_cluster*.py``."""
    folder, _, name = nodeid.split("::")[0].rpartition("/")
    return folder == "tests/operator" and (name.startswith("test_real_") or name.startswith("test_kube_cluster"))


def add_option(parser: pytest.Parser) -> None:
    parser.addoption(OPTION, default=None, metavar="DIR", type=Path,
                     help="run the real cluster's files first and stop the tools/kube-cluster cluster in DIR once "
                          "the last of their tests has finished (make test passes it)")


def register(config: pytest.Config) -> None:
    """Register the plugin when the option names a cluster folder; refuse one that holds no cluster."""
    folder: Path | None = config.getoption(OPTION)
    if folder is None:
        return
    if not (folder / "kube-apiserver.pid").is_file() and not hasattr(config, "workerinput"):
        raise pytest.UsageError(f"{OPTION}={folder}: no tools/kube-cluster cluster there (no kube-apiserver.pid)")
    config.pluginmanager.register(ClusterUsers(folder, worker=hasattr(config, "workerinput")), "kube-cluster-users")


class ClusterUsers:
    """Orders the cluster's files first where tests are collected, and stops the cluster where reports arrive."""

    def __init__(self, folder: Path, worker: bool) -> None:
        self.folder = folder
        self.worker = worker
        self.strays: set[str] = set()  # tests that request the cluster outside its files
        self.pending: set[str] | None = None  # the cluster's tests not yet torn down; None before collection
        self.started = time.monotonic()
        self.down: subprocess.Popen[str] | None = None
        self.down_at = 0.0

    @pytest.hookimpl(trylast=True)  # after tests/conftest.py's longest-first order, which stays within each part
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.strays = {item.nodeid for item in items
                       if FIXTURE in getattr(item, "fixturenames", ()) and not needs_cluster(item.nodeid)}
        items.sort(key=lambda item: not needs_cluster(item.nodeid))

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """A test outside the cluster's files that requests it errors, naming the rule (every process collects the
        same tests, so this cannot be a collection error of one xdist worker's)."""
        if item.nodeid in self.strays:
            pytest.fail(f"{item.nodeid} requests the `{FIXTURE}` fixture outside the real cluster's files "
                        f"(tests/operator/test_real_*.py, test_kube_cluster*.py), and {OPTION} may have stopped "
                        f"the cluster before it runs: move it into such a file", pytrace=False)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if not self.worker:  # pytest without xdist workers: this process runs the tests too
            self._collected([item.nodeid for item in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: object, ids: list[str]) -> None:
        if self.pending is None:  # every worker collects the same tests
            self._collected(ids)

    def _collected(self, ids: list[str]) -> None:
        self.pending = {nodeid for nodeid in ids if needs_cluster(nodeid)}
        self._stop_if_unused()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.worker or self.pending is None or report.when != "teardown":
            return
        self.pending.discard(report.nodeid)
        self._stop_if_unused()

    def _stop_if_unused(self) -> None:
        if self.pending or self.down is not None:
            return
        self.down_at = time.monotonic() - self.started
        self.down = subprocess.Popen([str(TOOL), "down", str(self.folder)], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.down is None:
            return
        try:
            output, _ = self.down.communicate(timeout=DOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            output = f"still stopping after {DOWN_TIMEOUT_S:.0f} s (make test's own `down` follows)"
        terminalreporter.write_line(f"kube-cluster: no test left needs it {self.down_at:.0f} s into the run: "
                                    f"{output.strip().splitlines()[-1] if output.strip() else 'down ran'}")
