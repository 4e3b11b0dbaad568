"""The ranks of a test's process group as children forked from one process that has imported what they run: a
process's start, importing torch, costs more than most ranks' work. Each child runs its call and exits with its
code (``os._exit``: no teardown of what the parent imported); the ranks meet over gloo as separate processes."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Iterable
from typing import Any


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
