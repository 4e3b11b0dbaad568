"""A pytest plugin that measures the CPU each test costs, its own processes' and every process it starts.

The suite is CPU-bound on a small machine (its wall time follows the CPU its tests burn, not their waits), and most
of a test's CPU is in the engines, servers and ranks it starts, which a profiler of the test process never sees.
Each worker moves itself into a cgroup v1 ``cpuacct`` group of its own (root only), which every child inherits, and
reads the group's counter around each test: the whole tree's CPU, killed processes included, however loaded the
machine is. Usage::

    SUITE_CPU_OUT=/tmp/cpu.jsonl python -m pytest -p tools.suite_cpu -n 3 --dist loadfile
    python tools/suite_cpu.py /tmp/cpu.jsonl      # CPU by file, the most first
    python tools/suite_cpu.py /tmp/cpu.jsonl --weights tests/file_weights.json   # files' wall time: the suite's order
    python tools/suite_cpu.py /tmp/cpu.jsonl --workers 3 4 5   # the run's length with other worker counts (a model)
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")


def _group() -> Path | None:
    group = CPUACCT / f"suite-cpu-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return None
    return group


GROUP = _group() if os.environ.get("SUITE_CPU_OUT") else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    if GROUP is None:
        yield
        return
    before = int((GROUP / "cpuacct.usage").read_text())
    started = time.time()
    yield
    spent = (int((GROUP / "cpuacct.usage").read_text()) - before) / 1e9
    ended = time.time()
    # The processes left in the group once the test is done: one a test leaked burns CPU the tests after it are
    # charged for, and shows here as a count that grows.
    procs = len((GROUP / "cgroup.procs").read_text().split())
    with open(os.environ["SUITE_CPU_OUT"], "a") as out:
        out.write(json.dumps({"test": item.nodeid, "cpu_s": round(spent, 3), "wall_s": round(ended - started, 3),
                              "end": round(ended, 3), "procs": procs,
                              "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}) + "\n")


def by_file_and_worker(path: str) -> tuple[dict[str, float], dict[str, float], dict[str, list[float]]]:
    """Each file's CPU and wall seconds, and each worker's first start and last end (for rows that carry them)."""
    cpu: dict[str, float] = collections.Counter()
    wall: dict[str, float] = collections.Counter()
    spans: dict[str, list[float]] = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        name = row["test"].split("::")[0]
        cpu[name] += row["cpu_s"]
        wall[name] += row.get("wall_s", 0.0)
        if "end" in row:
            span = spans.setdefault(row["worker"], [row["end"] - row["wall_s"], row["end"]])
            span[0], span[1] = min(span[0], row["end"] - row["wall_s"]), max(span[1], row["end"])
    return cpu, wall, spans


def report(path: str) -> None:
    """CPU and wall time by file, the most CPU first; then when each worker ran out of files (a late finish is a
    long file picked up late: the suite's tail)."""
    by_file, wall_by_file, spans = by_file_and_worker(path)
    total = sum(by_file.values())
    print(f"{total:8.0f} s CPU in all")
    for name, spent in sorted(by_file.items(), key=lambda kv: -kv[1]):
        print(f"{spent:8.1f} s {100 * spent / total:5.1f}%  {wall_by_file[name]:7.1f} s wall  {name}")
    if spans:
        start = min(first for first, _ in spans.values())
        for worker, (_, last) in sorted(spans.items()):
            print(f"worker {worker or '-'}: last test ended at {last - start:7.1f} s")


def write_weights(path: str, out: str) -> None:
    """Each file's wall seconds in the run, which ``tests/conftest.py`` orders the suite by (longest first)."""
    wall: dict[str, float] = collections.Counter()
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        wall[row["test"].split("::")[0]] += row["wall_s"]
    ordered = dict(sorted(((name, round(seconds, 1)) for name, seconds in wall.items()), key=lambda kv: -kv[1]))
    Path(out).write_text(json.dumps(ordered, indent=0) + "\n")


def _makespan(files: list[tuple[float, float]], workers: int, cores: float) -> float:
    """How long ``files`` (CPU seconds, the cores each would use alone), handed in order to ``workers`` as each runs
    out, take on ``cores`` shared in proportion when they ask for more than there is."""
    queue, running, now = list(files), [], 0.0
    while queue or running:
        while queue and len(running) < workers:
            cpu, rate = queue.pop(0)
            running.append([cpu, rate])
        share = min(1.0, cores / sum(rate for _, rate in running))
        step = min(left / (rate * share) for left, rate in running)
        for entry in running:
            entry[0] -= entry[1] * share * step
        running = [entry for entry in running if entry[0] > 1e-9]
        now += step
    return now


def predict(path: str, counts: list[int], cores: float = 2.0) -> None:
    """The run's length with other worker counts. Each file needs its CPU and, alone, would use cores at ``boost``
    times the rate it got in this run (its CPU over its wall time, capped at one core: a file is one worker's); the
    boost is the one that makes the model take as long as this run did with this run's workers, in the order
    ``tests/conftest.py`` gives the files. Waiting files (the real cluster's) leave cores to the others; more
    workers fill them, and contend where there were none to fill."""
    cpu, wall, spans = by_file_and_worker(path)
    measured = max(last for _, last in spans.values()) - min(first for first, _ in spans.values())
    weights = json.loads((Path(__file__).parents[1] / "tests" / "file_weights.json").read_text())
    order = sorted(cpu, key=lambda name: -weights.get(name, 0.0))

    def files(boost: float) -> list[tuple[float, float]]:
        return [(max(cpu[n], 1e-3), min(1.0, boost * max(cpu[n], 1e-3) / max(wall[n], 1e-3))) for n in order]

    low, high = 1.0, 20.0
    for _ in range(40):  # the boost that reproduces the measured run
        mid = (low + high) / 2
        low, high = (mid, high) if _makespan(files(mid), len(spans), cores) > measured else (low, mid)
    print(f"this run: {len(spans)} workers, {measured:.0f} s, {sum(cpu.values()):.0f} CPU-s; boost {low:.2f}")
    for count in counts:
        print(f"{count} workers: {_makespan(files(low), count, cores):7.0f} s")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[2] == "--weights":
        write_weights(sys.argv[1], sys.argv[3])
    elif len(sys.argv) > 3 and sys.argv[2] == "--workers":
        predict(sys.argv[1], [int(count) for count in sys.argv[3:]])
    else:
        report(sys.argv[1])
