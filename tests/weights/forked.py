"""Trainer processes of the weight tests, forked from one that imported torch already.

A trainer script's rank is a process of its own (it joins gloo groups, and a fault test kills it), but starting
one as a fresh interpreter makes it import torch first, which costs more than a small refit. multiprocessing's
fork server imports :data:`PRELOAD` once, on its first start in a test worker, and forks every rank from there:
each child runs the script as ``__main__`` with its own argv and environment, its stdout and stderr in files, and
ends as a process does (its exit code, or minus the signal that killed it). :func:`start_forked` starts one that
reads its stdin from the caller and writes its stdout to it (a trainer serving many runs).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import runpy
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

# the sender too: every trainer script imports it (~0.1 s of CPU in each rank, once in the server instead)
PRELOAD = ["torch", "torch.distributed", "megatron_serve", "megatron_serve.client.coordinator_client",
           "megatron_serve.client.weight_sender"]
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


@dataclass(frozen=True)
class Ended:
    """How one forked script ended: its exit code (minus the signal that killed it) and what it printed."""

    code: int
    stdout: str
    stderr: str


def _main(script: str, argv: list[str], env: dict[str, str], out: str | None, err: str) -> None:
    """The child: the environment, stdout (the file ``out``; ``None``: as it is) and stderr the script gets, then
    the script as ``__main__`` (its ``SystemExit`` is the process's exit code)."""
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        if path is None:
            continue
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script` has it: what lies beside it
    runpy.run_path(script, run_name="__main__")


def run_forked(script: Path, argvs: list[list[str]], env: dict[str, str], timeout: float,
               own_envs: list[dict[str, str]] | None = None) -> list[Ended]:
    """``script`` once per argv, side by side, each in a process of its own; how each ended, in order. One still
    running after ``timeout`` seconds is killed (and reads as killed). ``own_envs``: each process's variables over
    ``env`` (a rank's ``RANK``, as a launcher sets it), one per argv."""
    own_envs = own_envs if own_envs is not None else [{} for _ in argvs]
    assert len(own_envs) == len(argvs), "own_envs: one environment per argv"
    with tempfile.TemporaryDirectory(prefix="forked-") as logs:
        paths = [(os.path.join(logs, f"{i}.out"), os.path.join(logs, f"{i}.err")) for i in range(len(argvs))]
        procs = [_CONTEXT.Process(target=_main, args=(str(script), argv, {**env, **own}, *path), daemon=True)
                 for argv, own, path in zip(argvs, own_envs, paths)]
        for proc in procs:
            proc.start()
        try:
            for proc in procs:
                proc.join(timeout)
        finally:
            for proc in procs:
                if proc.exitcode is None:
                    proc.kill()
                    proc.join(10)
        return [Ended(proc.exitcode, Path(out).read_text(errors="replace"), Path(err).read_text(errors="replace"))
                for proc, (out, err) in zip(procs, paths)]


def _serve(script: str, argv: list[str], env: dict[str, str], stdin: multiprocessing.connection.Connection,
           stdout: multiprocessing.connection.Connection, err: str) -> None:
    """The child of :func:`start_forked`: the pipes' descriptors as its stdin and stdout (multiprocessing gave it
    devnull for stdin), stderr to ``err``, then the script as ``__main__``."""
    os.dup2(stdin.fileno(), 0)
    os.dup2(stdout.fileno(), 1)
    stdin.close()
    stdout.close()
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin, for its life
    _main(script, argv, env, None, err)


def start_forked(script: Path, argv: list[str], env: dict[str, str],
                 err: str) -> tuple[multiprocessing.process.BaseProcess, IO[str], IO[str]]:
    """``script`` with ``argv`` in a process of its own, forked, its stderr in file ``err``; the process, a
    line-buffered text stream to its stdin and one from its stdout (closing the first ends its stdin)."""
    to_child, from_child = os.pipe(), os.pipe()
    # as Connections: multiprocessing hands their descriptors to the fork server's child (a bare number would not)
    child_ends = (multiprocessing.connection.Connection(to_child[0], writable=False),
                  multiprocessing.connection.Connection(from_child[1], readable=False))
    proc = _CONTEXT.Process(target=_serve, args=(str(script), argv, env, *child_ends, err), daemon=True)
    try:
        proc.start()  # the fork server got its copies of the child's ends
    finally:
        for end in child_ends:
            end.close()
    return proc, open(to_child[1], "w", buffering=1), open(from_child[0])  # noqa: SIM115 - the caller's to close
