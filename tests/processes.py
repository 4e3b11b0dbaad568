"""Starting ``megatron-serve`` commands as a user does, each in a session of its own (``start_new_session=True``),
and stopping those process groups."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def start_cli(argv: list[str], output: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """``megatron-serve ARGV`` in a session of its own (its children in its group, for
    :func:`stop_process_group`), stdout and stderr into the file ``output``, nothing on stdin."""
    with open(output, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "megatron_serve.cli", *argv], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env)


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
