"""CPU seconds a ``megatron-serve run --engines 2`` costs to reach ``/ready``, and one engine's restart, with its
engines forked from the fleet's launcher (``--engine-start fork``) against fresh interpreters (``exec``).

The test suite starts such fleets well over a hundred times on two shared cores, so what counts is CPU time, not
wall time, which other work moves. Each run goes into a cgroup v1 ``cpuacct`` group of its own (root only; its
children inherit it, so killed processes count too) and the group's counter is read: at its start, once ``/ready``
says two engines serve, then around a ``kill -9`` of one engine until ``/ready`` says two serve again with the
replacement among them. The modes alternate, ``--repeat`` rounds of each; reported: the median and the range.

    python benchmarks/fleet_start_cpu.py                 # 3 rounds, the tiny model under a temporary directory
    python benchmarks/fleet_start_cpu.py --repeat 5 --model /tmp/tiny

Figures: docs/design-measurements.md ("Engines forked from a launcher").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from megatron_serve.fleet.supervisor import stop_process_group

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
MODES = ("fork", "exec")


def cpu_group(name: str) -> Path:
    """A fresh ``cpuacct`` group (refused, naming why, where cgroup v1's cpuacct is not writable)."""
    group = CPUACCT / name
    try:
        group.mkdir()
    except OSError as exc:
        raise SystemExit(f"fleet_start_cpu: cannot make the cgroup {group} ({exc}): run as root on a host with "
                         "cgroup v1's cpuacct mounted") from exc
    return group


def usage(group: Path) -> float:
    """The group's CPU seconds so far (user + system, every process that was in it)."""
    return int((group / "cpuacct.usage").read_text()) / 1e9


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ready_engines(url: str) -> int:
    """How many engines ``/ready`` says serve (0 while it is not ready or does not answer)."""
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=5) as answer:
            body = json.loads(answer.read())
    except (OSError, ValueError):
        return 0
    return body.get("engines", 0) if body.get("ready") else 0


def engines(run_pid: int) -> set[int]:
    """The run's engine processes (forked by its launcher, or its own children), by their command line."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            session = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3])
        except (OSError, IndexError, ValueError):
            continue
        if b"megatron_serve.cli engine " in argv and session == int(entry.name) and is_under(int(entry.name), run_pid):
            found.add(int(entry.name))
    return found


def is_under(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
        if pid == ancestor:
            return True
    return False


def wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout:.0f}s")
        time.sleep(0.1)


@contextlib.contextmanager
def running(model: str, mode: str, group: Path, log: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """``run --engines 2 --engine-start MODE`` in ``group`` (moved there before its interpreter starts), stopped when
    the block ends; yields it and its URL."""
    port = free_port()

    def join_group() -> None:
        (group / "cgroup.procs").write_text(str(os.getpid()))

    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_serve.cli", "run", "--model", model, "--engines", "2", "--port", str(port),
             "--coordinator-port", "0", "--insecure", "--engine-start", mode],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=join_group)
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        stop_process_group(proc, signal.SIGTERM)


def one_round(model: str, mode: str, directory: Path, index: int, timeout: float) -> tuple[float, float]:
    """(CPU seconds to two ready engines, CPU seconds of one engine's restart) for one run in ``mode``."""
    group = cpu_group(f"fleet-start-cpu-{os.getpid()}-{mode}-{index}")
    try:
        with running(model, mode, group, directory / f"{mode}-{index}.log") as (proc, url):
            wait(lambda: ready_engines(url) == 2 or proc.poll() is not None, timeout, "two ready engines")
            if proc.poll() is not None:
                raise RuntimeError(f"run exited with {proc.returncode}: see {directory / f'{mode}-{index}.log'}")
            start = usage(group)
            before = engines(proc.pid)
            victim = min(before)
            os.kill(victim, signal.SIGKILL)
            wait(lambda: len(engines(proc.pid) - before) == 1 and ready_engines(url) == 2, timeout,
                 "the killed engine's replacement, ready")
            return start, usage(group) - start
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()


def tiny_model(directory: Path) -> str:
    path = directory / "tiny"
    subprocess.run([sys.executable, "-m", "megatron_serve.cli", "make-tiny-model", str(path)], check=True,
                   stdout=subprocess.DEVNULL)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: a tiny model made under a temporary directory)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of each mode")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a stage may take")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    with tempfile.TemporaryDirectory(prefix="fleet-start-cpu-") as tmp:
        directory = Path(tmp)
        model = args.model or tiny_model(directory)
        results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
        for index in range(args.repeat):
            for mode in MODES:
                results[mode].append(one_round(model, mode, directory, index, args.timeout))
                print(f"round {index} {mode}: start {results[mode][-1][0]:.2f} CPU-s, "
                      f"restart {results[mode][-1][1]:.2f} CPU-s", flush=True)
    print(f"CPU seconds (user + system, the run's whole process tree), {args.repeat} runs each: median [min - max]")
    for stage, column in (("to two ready engines", 0), ("one engine's restart", 1)):
        for mode in MODES:
            values = [result[column] for result in results[mode]]
            print(f"  {stage:22s} {mode:5s} {statistics.median(values):6.2f}  [{min(values):.2f} - {max(values):.2f}]")


if __name__ == "__main__":
    main()
