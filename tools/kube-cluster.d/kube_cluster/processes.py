"""Starting and stopping the cluster's processes, each with `DIR/<name>.pid`, `.log` and `.cmd`.

A process runs in a session of its own, so it outlives `up` and a test runner's process group;
`down` stops exactly the pids it wrote (after checking that the pid still runs the binary it
started, since pids are reused), and the `.cmd` file lets `restart` bring one back with the same
arguments (an API-server restart with etcd kept).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    """A port free now on 127.0.0.1 (the kernel picks it; tests run clusters side by side)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _pid_file(folder: Path, name: str) -> Path:
    return folder / f"{name}.pid"


def running(folder: Path, name: str) -> int | None:
    """The pid of `name` if its pid file names a live process still running what was started."""
    pid_file = _pid_file(folder, name)
    if not pid_file.exists():
        return None
    pid = int(pid_file.read_text().split()[0])
    command = json.loads((folder / f"{name}.cmd").read_text())["argv"]
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None
    if state == "Z" or not cmdline or cmdline[0].decode() != command[0]:
        return None
    return pid


def start(folder: Path, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
    """Start `argv` detached, logging to DIR/<name>.log (appended, so restarts keep history)."""
    if running(folder, name):
        raise SystemExit(f"kube-cluster: {name} already runs in {folder} (pid {running(folder, name)}); "
                         f"run `tools/kube-cluster down {folder}` first")
    (folder / f"{name}.cmd").write_text(json.dumps({"argv": argv, "env": env or {}}, indent=1) + "\n")
    return _spawn(folder, name, argv, env or {})


def _spawn(folder: Path, name: str, argv: list[str], extra_env: dict[str, str]) -> int:
    log = (folder / f"{name}.log").open("ab")
    log.write(f"\n=== kube-cluster: start {time.strftime('%Y-%m-%dT%H:%M:%S')} ===\n".encode())
    log.flush()
    environment = dict(os.environ)
    environment.update(extra_env)
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                               cwd=folder, env=environment, start_new_session=True)
    log.close()
    _pid_file(folder, name).write_text(f"{process.pid}\n")
    return process.pid


def restart(folder: Path, name: str) -> int:
    """Stop `name` if it runs and start it again with the arguments it was first started with."""
    command_file = folder / f"{name}.cmd"
    if not command_file.exists():
        raise SystemExit(f"kube-cluster: no component named {name!r} was started in {folder}")
    stop(folder, name)
    saved = json.loads(command_file.read_text())
    return _spawn(folder, name, saved["argv"], saved["env"])


def stop(folder: Path, name: str, grace: float = 15.0, again: float = 3.0) -> bool:
    """SIGTERM, a second SIGTERM after `again` seconds, SIGKILL after `grace`; True if a process was stopped.

    kube-apiserver shuts its controllers down within a second of the first SIGTERM and then does not exit (the
    full `grace` every time, measured here); the Kubernetes components take a second signal as "exit now".
    """
    pid = running(folder, name)
    _pid_file(folder, name).unlink(missing_ok=True)
    if pid is None:
        return False
    os.kill(pid, signal.SIGTERM)
    started = time.monotonic()
    signals = [signal.SIGTERM]
    while time.monotonic() < started + grace:
        if not Path(f"/proc/{pid}").exists() or _zombie(pid):
            return True
        if len(signals) == 1 and time.monotonic() > started + again:
            os.kill(pid, signal.SIGTERM)
            signals.append(signal.SIGTERM)
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    return True


def cpu_seconds(folder: Path, name: str) -> float | None:
    """CPU seconds `name` has used since it started (user and system, /proc/PID/stat), None if it is not running."""
    pid = running(folder, name)
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def started_names(folder: Path) -> list[str]:
    """Names with a pid file in DIR, in the order they were started (oldest first)."""
    files = sorted(folder.glob("*.pid"), key=lambda p: p.stat().st_mtime)
    return [p.stem for p in files]


def wait(what: str, check: Callable[[], object], timeout: float, log: Path | None = None,
         interval: float = 0.25) -> object:
    """Poll `check()` until it returns a true value; fail naming `what` (and the log's tail)."""
    deadline = time.monotonic() + timeout
    last_error = ""
    while time.monotonic() < deadline:
        try:
            answer = check()
        except Exception as error:  # noqa: BLE001 - any failure of a probe means "not yet"
            last_error = f"{type(error).__name__}: {error}"
            answer = None
        if answer:
            return answer
        time.sleep(interval)
    tail = ""
    if log is not None and log.exists():
        tail = "\n--- " + str(log) + " (last lines) ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-25:])
    raise SystemExit(f"kube-cluster: timed out after {timeout:.0f} s waiting for {what}"
                     + (f" (last error: {last_error})" if last_error else "") + tail)
