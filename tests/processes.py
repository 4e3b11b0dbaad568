"""Stopping the process groups that tests start (``start_new_session=True``)."""

from __future__ import annotations

import os
import signal
import subprocess


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
