"""The ranks of a test's process group as children forked from one process that has imported what they run: a
process's start, importing torch, costs more than most ranks' work. Each child runs its call and exits with its
code (``os._exit``: no teardown of what the parent imported); the ranks meet over gloo as separate processes.

The children share their parent's stdout, and gloo or torch may write lines of their own to it: a rank tells its
result with :func:`report` (one marked line in one write, whole however the ranks interleave), and the test reads
the marked lines alone with :func:`reports`. A test forks its ranks from its own process with :func:`forked_reports`
(it has imported torch already); a script whose ranks need a process apart from the test's (an environment or a
patched module of their own) forks them with :func:`fork_ranks`."""

from __future__ import annotations

import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch


#: What starts a rank's report on the shared stdout.
REPORT = "rank-report|"


def report(*fields: object) -> None:
    """Write ``fields`` as one marked line, in one write (a line printed in pieces could interleave with another's)."""
    os.write(1, f"{REPORT}{'|'.join(map(str, fields))}\n".encode())


def reports(output: str) -> list[list[str]]:
    """The fields of each rank's report in ``output``, the other lines left out."""
    return [line.removeprefix(REPORT).split("|") for line in output.splitlines() if line.startswith(REPORT)]


def fork_ranks(target: Callable[..., Any], calls: Iterable[tuple], timeout: float | None = None) -> int:
    """``target(*args)`` for each ``args`` of ``calls``, each in a child forked from this process, all at once;
    returns how many children failed (a traceback printed for each), once all have exited. Past ``timeout`` seconds
    the children still running are killed and a ``TimeoutError`` says how many (a rank waiting for one that failed
    waits out its group's time-out)."""
    return _failed(_fork(target, calls, None), None if timeout is None else time.monotonic() + timeout)


def forked_reports(target: Callable[..., Any], calls: Iterable[tuple],
                   timeout: float = 120) -> tuple[int, list[list[str]]]:
    """:func:`fork_ranks` from the test's own process, which has imported what the ranks run (no script started to
    import it again): each child's stdout is a pipe read here (pytest holds the test's). Returns how many children
    failed and their reports (:func:`reports`)."""
    deadline = time.monotonic() + timeout
    read, write = os.pipe()
    try:
        children = _fork(target, calls, write)
    finally:
        os.close(write)
    output = []
    with os.fdopen(read, "rb", buffering=0) as pipe:  # read as it comes: a full pipe would stop a child writing
        while select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = pipe.read(65536)
            if not chunk:  # the end of the file: every child has exited
                break
            output.append(chunk)
    return _failed(children, deadline), reports(b"".join(output).decode(errors="replace"))


def _fork(target: Callable[..., Any], calls: Iterable[tuple], stdout: int | None) -> list[int]:
    children = []
    sys.stdout.flush()  # what this process holds unwritten would be written again by each child
    sys.stderr.flush()
    for args in calls:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                if stdout is not None:
                    os.dup2(stdout, 1)
                # a parent that ran OpenMP's thread pool leaves it unusable here: a parallel region would hang
                torch.set_num_threads(1)
                target(*args)
                code = 0
            except BaseException:  # noqa: BLE001 - printed, and the exit code says it
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.append(pid)
    return children


def _failed(children: list[int], deadline: float | None) -> int:
    codes: dict[int, int] = {}
    while True:
        for pid in children:
            if pid not in codes:
                done, status = os.waitpid(pid, 0 if deadline is None else os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        running = [pid for pid in children if pid not in codes]
        if not running:
            return sum(code != 0 for code in codes.values())
        if deadline is not None and time.monotonic() > deadline:
            for pid in running:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            raise TimeoutError(f"{len(running)} of {len(children)} forked ranks still ran at their time-out: killed")
        time.sleep(0.05)
