"""Options of the whole suite (pytest accepts an option from any directory only when the suite's root registers it),
and the fixtures several folders share: tiny models written once per session, in-process fleets of fake engines."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import threading
from importlib.metadata import version
from pathlib import Path

import pytest

from .operator import cluster_users
from .parity.options import add_options


# OpenMP threads that ran out of work wait asleep rather than spin (OpenMP's default): on a small machine every
# process's spinning threads took the cores from the processes with work, most of the suite's CPU
# (docs/testing.md). Set before a test module imports torch; every process a test starts inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# One intra-op thread a process, but in the folders whose tests are about arithmetic under threads
# (tests/threads.py): the workers, each with engines and ranks of their own, keep two cores busy without a second
# OpenMP thread in each process, which only added synchronisation (docs/testing.md has the figures).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# oneDNN below AMX in every process of the suite, as the batch-invariant mode sets it for its own process
# (megatron_kernels.invariant.NO_AMX): oneDNN reads it at its first GEMM, and a worker runs many tests' GEMMs before
# an invariant one. A machine without AMX is unaffected.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)
    cluster_users.add_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    cluster_users.register(config)  # make test's early stop of its control plane (tests/operator/cluster_users.py)


#: Seconds each test file took in a whole-suite run (``tools/suite_cpu.py --weights``): longest first.
FILE_WEIGHTS = Path(__file__).with_name("file_weights.json")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first. pytest-xdist hands a worker its next file as it runs out (``--dist loadfile``,
    with ``--no-loadscope-reorder`` so that this order stands): a long file picked up last is the suite's tail,
    two cores idle but one. A file missing from the table (a new one) keeps its place after the weighed ones;
    the sort is stable, so a file's tests keep their order."""
    try:
        weights: dict[str, float] = json.loads(FILE_WEIGHTS.read_text())
    except (OSError, ValueError):
        return
    items.sort(key=lambda item: -weights.get(item.nodeid.split("::")[0], 0.0))


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, transformers, every test module: most of a worker's heap) leaves the
    cyclic collector's view: each full collection walked it all again, some 0.16 s a time, several per test file,
    though none of it is ever garbage."""
    gc.collect()
    gc.freeze()


PARITY_COMPARE = "tests.parity.compare"  # the parity searches' tallies; imported only where a search ran


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A pytest-xdist worker hands its parity tallies to the controller, which prints the whole run's summary."""
    workeroutput = getattr(session.config, "workeroutput", None)  # set only in an xdist worker
    compare = sys.modules.get(PARITY_COMPARE)
    if workeroutput is not None and compare is not None:
        workeroutput["parity_tallies"] = {name: dataclasses.asdict(t) for name, t in compare.TALLIES.items()}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # noqa: ANN001 - xdist's WorkerController; runs on the controller
    tallies = node.workeroutput.get("parity_tallies") if hasattr(node, "workeroutput") else None
    if tallies:
        from .parity.compare import TALLIES, Tally  # noqa: PLC0415 (torch: only when a search ran)

        for name, fields in tallies.items():
            TALLIES.setdefault(name, Tally()).merge(Tally(**fields))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.write_line(machine_line())
    compare = sys.modules.get(PARITY_COMPARE)
    for name, tally in (compare.TALLIES.items() if compare is not None else ()):
        terminalreporter.write_line(f"parity {name}: {tally.line()}")


def machine_line() -> str:
    """What the run had to work with, so a slow CI run can be told from a slow suite."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    build = f"torch {version('torch')}"
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
    return (f"machine: {cores} usable cores of {os.cpu_count()}, {pages / 2**30:.0f} GiB, load {os.getloadavg()}, "
            f"{build}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
            f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA')}")


#: Seconds past a test's limit after which the backstop below ends its worker.
TIMEOUT_BACKSTOP_S = 60.0
BACKSTOP = pytest.StashKey[threading.Timer]()


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings) -> None:  # noqa: ANN001 - pytest-timeout's Settings
    """A backstop behind the signal method: SIGALRM raises its failure in whatever the main thread runs, and in an
    asyncio test that is often another task of the test's loop (the API double's request handler, a fake
    controller): that task ends, the test goes on, and no second alarm comes. Still running a minute past its limit,
    the test gets the thread method's end instead (every thread's stack, then its worker exits; make test stops at
    a crashed worker) rather than holding the run until CI's own limit. pytest-timeout's own timer still runs."""
    if settings.method != "signal" or not settings.timeout:
        return
    from pytest_timeout import timeout_timer  # noqa: PLC0415 (only where pytest-timeout calls this hook)

    backstop = threading.Timer(settings.timeout + TIMEOUT_BACKSTOP_S, timeout_timer, (item, settings))
    backstop.daemon = True
    backstop.start()
    item.stash[BACKSTOP] = backstop


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    backstop = item.stash.get(BACKSTOP, None)
    if backstop is not None:
        backstop.cancel()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny random Llama for the engine, model and client tests."""
    from megatron_serve.model.tiny import make_tiny_model  # noqa: PLC0415 (torch: only for the suites that use it)

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed=0, arch="llama"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random model for fleet tests (folders with their own ``tiny_model`` override it)."""
    from megatron_serve.model.tiny import make_tiny_model  # noqa: PLC0415

    return str(make_tiny_model(tmp_path_factory.mktemp("coordinator-tiny"), seed=0))


@pytest.fixture
def fleet_factory():
    """Starts in-process fleets (``tests/inprocess_fleet.py``) and stops them after the test."""
    from .inprocess_fleet import InProcessFleet  # noqa: PLC0415

    fleets: list[InProcessFleet] = []

    def make(**kwargs) -> InProcessFleet:
        fleet = InProcessFleet(**kwargs)
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        fleet.stop()
