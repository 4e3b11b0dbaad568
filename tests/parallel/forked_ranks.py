"""The ranks of a test's process group as children forked from one process that has imported what they run: a
process's start, importing torch, costs more than most ranks' work. Each child runs its call and exits with its
code (``os._exit``: no teardown of what the parent imported); the ranks meet over gloo as separate processes.

The children share their parent's stdout, and gloo or torch may write lines of their own to it: a rank tells its
result with :func:`report` (one marked line in one write, whole however the ranks interleave), and the test reads
the marked lines alone with :func:`reports`."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Iterable
from typing import Any


#: What starts a rank's report on the shared stdout.
REPORT = "rank-report|"


def report(*fields: object) -> None:
    """Write ``fields`` as one marked line, in one write (a line printed in pieces could interleave with another's)."""
    os.write(1, f"{REPORT}{'|'.join(map(str, fields))}\n".encode())


def reports(output: str) -> list[list[str]]:
    """The fields of each rank's report in ``output``, the other lines left out."""
    return [line.removeprefix(REPORT).split("|") for line in output.splitlines() if line.startswith(REPORT)]


def fork_ranks(target: Callable[..., Any], calls: Iterable[tuple]) -> int:
    """``target(*args)`` for each ``args`` of ``calls``, each in a child forked from this process, all at once;
    returns how many children failed (a traceback printed for each), once all have exited."""
    children = []
    for args in calls:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                target(*args)
                code = 0
            except BaseException:  # noqa: BLE001 - printed, and the exit code says it
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.append(pid)
    return sum(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0 for pid in children)
