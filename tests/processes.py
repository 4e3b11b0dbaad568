"""Starting ``megatron-serve`` commands as a user does, each in a session of its own (``start_new_session=True``),
and stopping those process groups (:func:`~megatron_serve.fleet.supervisor.stop_process_group`, the one the
benchmarks use too)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from megatron_serve.fleet.supervisor import stop_process_group

__all__ = ["start_cli", "stop_process_group"]


def start_cli(argv: list[str], output: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """``megatron-serve ARGV`` in a session of its own (its children in its group, for
    :func:`stop_process_group`), stdout and stderr into the file ``output``, nothing on stdin."""
    with open(output, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "megatron_serve.cli", *argv], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env)
