"""Stopping the process groups that tests start (``start_new_session=True``)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def stop_process_group(proc: subprocess.Popen, first: signal.Signals = signal.SIGINT, timeout: float = 60) -> None:
    """Send ``first`` to ``proc``'s group (what a terminal's Ctrl-C or a pod's stop sends), give it
    ``timeout`` seconds to exit, then SIGKILL the group. Nothing to do if it already exited."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, first)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _children(pid: int) -> list[tuple[int, bytes]]:
    """``(pid, command line)`` of each running child of ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found.append((int(entry.name), cmdline))
    return found


def rank_processes(engine_pid: int) -> list[int]:
    """The tensor-parallel ranks an engine process started: the children of its multiprocessing forkserver."""
    servers = [pid for pid, cmdline in _children(engine_pid) if b"multiprocessing.forkserver" in cmdline]
    return [pid for server in servers for pid, _ in _children(server)]
