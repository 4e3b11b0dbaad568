"""A ``megatron-serve run`` stack for the benchmarks that serve over HTTP: started in its own session on ports the
kernel picks, stopped, its processes found by role (HTTP server, coordinator, engines), their CPU time read, and
pinned to cores. ``serving.py`` and the benchmarks beside it (``host_ceiling.py``, ``tenants.py`` ...) start the
same stack this way, so their CPU columns count the same processes."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from scratch import scratch_dir


def start_stack(model_dir: str, engines: int, run_args: str) -> tuple[subprocess.Popen, str, Path]:
    """``megatron-serve run`` in its own session; returns it, its URL and its output file. It listens on a port the
    kernel gives it (``--port 0``), read from the file it publishes for ``control``: a port picked free here and bound
    later by the run could be taken meanwhile by another stack on the machine, which this would then measure."""
    from megatron_serve.commands.local_runs import live_runs  # noqa: PLC0415 - no runtime for a client

    log_dir = scratch_dir("bench-serving-")
    output = log_dir / "run.out"
    with open(output, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "megatron_serve.cli", "run", "--model", model_dir,
                                 "--port", "0", "--coordinator-port", "0", "--engines", str(engines),
                                 "--log-dir", str(log_dir), *shlex.split(run_args)],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={k: v for k, v in os.environ.items()
                                                             if k != "MEGATRON_SERVE_API_KEY"})
    url = None
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"megatron-serve run exited ({proc.returncode}):\n{output.read_text()}")
        # where `control` finds it (the run's environment is this process's): published once its ports are bound
        url = url or next((run.endpoint.removesuffix("/v1") for run in live_runs() if run.pid == proc.pid), None)
        try:
            if url and httpx.get(f"{url}/ready", timeout=2, verify=False).status_code == 200:  # plain HTTP: no CA
                return proc, url, output
        except httpx.TransportError:  # not listening yet
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"megatron-serve run was not ready after 600s:\n{output.read_text()}")
        time.sleep(0.2)


def stop_stack(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def stack_processes(run_pid: int) -> list[tuple[int, str]]:
    """The started stack's child processes and their roles: ``engines`` (forked by the run's launcher, or its own
    children), ``server`` (sibling API servers of ``--api-server-count``) or ``coordinator``."""
    processes = {}  # pid -> (parent, command line)
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            # `... cli engine --coordinator ...`: NUL-separated, or a forked engine's title, one string
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").split(b" ")
            processes[pid] = (int(_stat(pid)[1]), argv)
        except OSError:  # gone meanwhile
            continue
    parents = {run_pid} | {pid for pid, (parent, argv) in processes.items()
                           if parent == run_pid and b"megatron_serve.commands.launcher" in argv}
    found = []
    for pid, (parent, argv) in processes.items():
        if parent not in parents or pid in parents:
            continue
        server = (b"megatron_serve.commands.api_sibling", b"megatron_serve.server.probe_process")
        role = ("engines" if b"engine" in argv else "server" if any(m in argv for m in server) else "coordinator")
        found.append((pid, role))
    return found


def stack_cpu_seconds(run_pid: int) -> dict[str, float] | None:
    """CPU seconds (user + system) the started stack used so far: the ``run`` process and its sibling API servers
    (the HTTP server), its coordinator and its engines (Linux ``/proc``; None elsewhere)."""
    ticks = os.sysconf("SC_CLK_TCK")
    try:
        own = _stat(run_pid)
    except OSError:
        return None
    used = {"server": (int(own[11]) + int(own[12])) / ticks, "coordinator": 0.0, "engines": 0.0}
    for pid, role in stack_processes(run_pid):
        try:
            stat = _stat(pid)
        except OSError:
            continue
        used[role] += (int(stat[11]) + int(stat[12])) / ticks
    return used


def listening_pid(url: str) -> int | None:
    """The process that listens on ``url``'s port on this machine (of several sharing the socket, as
    ``--api-server-count`` siblings do, the one whose parent is not among them); None when the URL is not
    local or the process cannot be read (another user's)."""
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost", "::1", "0.0.0.0") or parts.port is None:
        return None
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == parts.port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    holders = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                holders.append(pid)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    roots = [pid for pid in holders if int(_stat(pid)[1]) not in holders]
    return roots[0] if roots else None


@dataclass
class Pinning:
    """Which cores each kind of process runs on (None: not pinned)."""

    engines: list[int] | None
    front: list[int] | None  # HTTP server(s), and the coordinator unless it has a core of its own
    cores: list[int] | None  # the benchmark's client: every core, or all but the coordinator's
    coordinator: list[int] | None = None  # a core of its own (``--pin-coordinator``); None: on ``front``

    @classmethod
    def plan(cls, engines: int, pin: bool, own_coordinator: bool = False) -> "Pinning":
        """``own_coordinator`` gives the coordinator the last core alone, as a deployment would: on a core shared
        with the HTTP server and the benchmark's client every wake-up of it runs with their memory in the caches, and
        its CPU per token read 13-47 run to run. The others keep the layout below on the remaining cores, or share
        them all when there are too few (on 2 cores: the coordinator on core 1, everything else on core 0)."""
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if own_coordinator and pin and len(cores) >= 2:
            rest = cores[:-1]
            if len(rest) < engines + 1:
                return cls(rest, rest, rest, cores[-1:])
            return cls(rest[-engines:], rest[:-engines], rest, cores[-1:])
        if not pin or len(cores) < engines + 1:
            return cls(None, None, None)
        return cls(cores[-engines:], cores[:-engines], cores)

    def describe(self) -> str:
        if self.engines is None:
            return "not pinned to cores (--no-pin, or fewer cores than engines + 1)"
        if self.coordinator is not None:
            return (f"coordinator alone on core {self.coordinator[0]}; served engines on cores {self.engines}, the "
                    f"offline engine on core {self.engines[0]}, HTTP server(s) on cores {self.front}, this client on "
                    f"cores {self.cores}")
        return (f"served engines on cores {self.engines} (one each), the offline engine on core {self.engines[0]}, "
                f"HTTP server(s) and coordinator on cores {self.front}")


def pin_process(pid: int, cores: list[int]) -> None:
    """Every thread of ``pid`` on ``cores`` (threads started later inherit it from theirs)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except OSError:  # a thread that ended meanwhile
            pass


def pin_stack(run_pid: int, pinning: Pinning) -> None:
    """Pin the started stack's processes as ``pinning`` says."""
    if pinning.engines is None or pinning.front is None:
        return
    pin_process(run_pid, pinning.front)
    engine = 0
    for pid, role in stack_processes(run_pid):
        if role == "engines":
            pin_process(pid, [pinning.engines[engine % len(pinning.engines)]])
            engine += 1
        elif role == "coordinator" and pinning.coordinator is not None:
            pin_process(pid, pinning.coordinator)
        else:
            pin_process(pid, pinning.front)
