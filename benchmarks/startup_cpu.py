"""CPU time each process of ``megatron-serve run`` spends until the run says it is ready.

The test suite starts hundreds of these processes on two shared cores, and a pod's start-up on a busy node pays
the same: so what counts is CPU time (user + system, from ``/proc/PID/stat``), not wall time, which other work on
the machine moves. Each repeat starts ``megatron-serve run --model DIR --port 0 --coordinator-port 0`` with the
tiny model (made with ``megatron-serve make-tiny-model`` when ``--model`` is not given), waits for the
"is ready" line, reads the CPU time of the run process and of each child by kind (engine, coordinator, probe
process, janitor), again once they all are idle (the probe process starts last), then stops it. Reported: the
median and the range over the repeats, per kind.

    python benchmarks/startup_cpu.py                  # 5 repeats, tiny model under a temporary directory
    python benchmarks/startup_cpu.py --repeat 9 --model /tmp/tiny

Figures: docs/design-measurements.md ("Start-up CPU").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from megatron_serve.fleet.supervisor import stop_process_group

#: The kinds of process, by a piece of their command line, first match wins (the run process is the parent).
KINDS = (("engine", "megatron_serve.cli engine"), ("launcher", "megatron_serve.commands.launcher"),
         ("coordinator", "megatron_serve.cli coordinator"),
         ("probe", "megatron_serve.server.probe_process"), ("janitor", "megatron_serve.commands.run_janitor"))
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (its children's not included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid``, found through ``/proc/*/stat`` parent links."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, p in parents.items() if p == parent]
        found += children
        frontier += children
    return found


def kind_of(pid: int) -> str | None:
    """The kind of a ``run`` child by its command line (None: another helper, such as a compiler)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return next((kind for kind, marker in KINDS if marker in argv), None)


#: The share of a core under which a process counts as settled (:func:`settled`).
IDLE_SHARE = 0.25


def cpu_by_kind(run_pid: int) -> dict[str, float]:
    """CPU seconds of the run process and of its children by kind (several of one kind: summed)."""
    cpu = {"run": cpu_seconds(run_pid)}
    for pid in descendants(run_pid):
        try:
            kind = kind_of(pid)
            if kind is not None:
                cpu[kind] = cpu.get(kind, 0.0) + cpu_seconds(pid)
        except OSError:
            continue
    return cpu


def settled(run_pid: int, timeout: float) -> dict[str, float]:
    """:func:`cpu_by_kind` once the processes have finished starting: the probe process starts after the main port
    is up and may still import at the "is ready" line, so this polls until a second passes in which no kind of
    process spent more than :data:`IDLE_SHARE` of a core. Starting, a process spends most of one; idle, each
    spends a few percent (heartbeats, the servers' fleet status polls), more on a loaded host."""
    before = cpu_by_kind(run_pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = cpu_by_kind(run_pid)
        if now.keys() == before.keys() and all(now[kind] - before[kind] < IDLE_SHARE for kind in now):
            return now
        before = now
    raise TimeoutError(f"the processes were still busy {timeout} s after ready")


@contextlib.contextmanager
def started(model: str, timeout: float) -> Iterator[int]:
    """A ``megatron-serve run`` of ``model`` (insecure, ports of its own), from its "is ready" line until the block
    ends, when it and its children are stopped; yields the run process's id."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_serve.cli", "run", "--model", model, "--port", "0",
         "--coordinator-port", "0", "--insecure"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "is ready" in line:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no 'is ready' within {timeout} s")
        else:
            raise RuntimeError(f"run ended before it was ready (exit code {proc.wait()})")
        yield proc.pid
    finally:
        stop_process_group(proc, signal.SIGTERM)


def one_start(model: str, timeout: float) -> tuple[dict[str, float], dict[str, float]]:
    """CPU seconds per kind of process at the run's "is ready" line, and once they all are idle."""
    with started(model, timeout) as pid:
        return cpu_by_kind(pid), settled(pid, timeout)


def report(title: str, runs: list[dict[str, float]]) -> None:
    print(f"CPU seconds (user + system) {title}, {len(runs)} starts: median [min - max]")
    for kind in ("run", *(k for k, _ in KINDS)):
        values = [r[kind] for r in runs if kind in r]
        if values:
            print(f"  {kind:12s} {statistics.median(values):5.2f}  [{min(values):.2f} - {max(values):.2f}]")
    total = [sum(r.values()) for r in runs]
    print(f"  {'all':12s} {statistics.median(total):5.2f}  [{min(total):.2f} - {max(total):.2f}]")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: a tiny model made for this run)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each start")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = str(Path(tmp) / "tiny")
            subprocess.run([sys.executable, "-m", "megatron_serve.cli", "make-tiny-model", model], check=True,
                           stdout=subprocess.DEVNULL)
        runs = [one_start(model, args.timeout) for _ in range(args.repeat)]
    report("at ready", [ready for ready, _ in runs])
    report("once idle", [idle for _, idle in runs])
    return 0


if __name__ == "__main__":
    sys.exit(main())
