"""Scripts and calls of the tests run in children forked from a process that has imported torch already.

A fresh interpreter spends ~2 CPU-s importing torch, more than most of what a test runs in a process of its own (a
benchmark's smoke run, a trainer's rank, a process group's rank). Each child here is a multiprocessing process made
one of two ways (``via``):

- ``"fork"``: forked from the calling process, with all it imported (a benchmark's smoke run, a test's process
  group): the cheapest child, and the caller's state as it stands at the fork.
- ``"forkserver"``: forked from the test worker's fork server, a process apart that imports :data:`PRELOAD` once, on
  its first start in a worker: no state of the caller's, whose process may run a fleet's threads, their locks held at
  any moment (the weight tests' trainers). Its children are daemonic: the worker's exit ends any still running.

Every child freezes the heap it inherited first (its collections then walk, and copy on write, only its own objects),
and ends by ``os._exit`` with its code: 0, a ``SystemExit``'s code, or 1 with the traceback on its stderr; so the
child tears down none of what its parent imported. A child still running at its caller's time-out is killed.
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import runpy
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any, Literal, NoReturn

import torch

from tests.helpers import process_children

Via = Literal["fork", "forkserver"]

# the sender too: every trainer script imports it (~0.1 s of CPU in each rank, once in the server instead)
PRELOAD = ["torch", "torch.distributed", "megatron_serve", "megatron_serve.client.coordinator_client",
           "megatron_serve.client.weight_sender"]
_CONTEXTS = {"fork": multiprocessing.get_context("fork"), "forkserver": multiprocessing.get_context("forkserver")}
_CONTEXTS["forkserver"].set_forkserver_preload(PRELOAD)

#: What starts a rank's report on the shared stdout (:func:`report`).
REPORT = "rank-report|"


@dataclass(frozen=True)
class Ended:
    """How a forked script ended: its exit code (minus the signal that killed it) and what it printed."""

    returncode: int
    stdout: str
    stderr: str


def run_scripts(script: Path, argvs: list[list[str]], env: dict[str, str], timeout: float, *, via: Via,
                own_envs: list[dict[str, str]] | None = None, exit_functions: bool = False) -> list[Ended]:
    """``script`` once per argv, side by side, each in a child of its own that runs it as ``__main__`` (its stdout
    and stderr in files); how each ended, in order. One still running after ``timeout`` seconds is killed (and reads as
    killed). ``env``: variables read while the script runs (``TMPDIR``, a rank's ``RANK``); those read at import
    (``OMP_*``) are the forking process's. ``own_envs``: each child's variables over ``env``, one per argv.
    ``exit_functions``: the child runs the exit functions the script registered (its scratch directory's removal),
    none of its parent's; without it, none at all."""
    own_envs = own_envs if own_envs is not None else [{} for _ in argvs]
    if len(own_envs) != len(argvs):
        raise ValueError(f"own_envs: one environment per argv ({len(own_envs)} for {len(argvs)})")
    with tempfile.TemporaryDirectory(prefix="forked-") as logs:
        paths = [(os.path.join(logs, f"{i}.out"), os.path.join(logs, f"{i}.err")) for i in range(len(argvs))]
        procs = [_start(via, partial(_script_main, str(script), argv, {**env, **own}, out, err), exit_functions)
                 for argv, own, (out, err) in zip(argvs, own_envs, paths, strict=True)]
        _join(procs, timeout)
        return [Ended(proc.exitcode, Path(out).read_text(errors="replace"), Path(err).read_text(errors="replace"))
                for proc, (out, err) in zip(procs, paths, strict=True)]


def start_script(script: Path, argv: list[str], env: dict[str, str],
                 err: str) -> tuple[multiprocessing.process.BaseProcess, IO[str], IO[str]]:
    """``script`` with ``argv`` in a child of the fork server, its stderr in file ``err``; the process, a
    line-buffered text stream to its stdin and one from its stdout (closing the first ends its stdin). The caller
    ends it (or the worker's exit does)."""
    to_child, from_child = os.pipe(), os.pipe()
    # as Connections: multiprocessing hands their descriptors to the fork server's child (a bare number would not)
    child_ends = (multiprocessing.connection.Connection(to_child[0], writable=False),
                  multiprocessing.connection.Connection(from_child[1], readable=False))
    try:
        proc = _start("forkserver", partial(_serve, str(script), argv, env, *child_ends, err), False)
    finally:  # the fork server got its copies of the child's ends
        for end in child_ends:
            end.close()
    return proc, open(to_child[1], "w", buffering=1), open(from_child[0])  # noqa: SIM115 - the caller's to close


def fork_ranks(target: Callable[..., Any], calls: Iterable[tuple], timeout: float | None = None) -> int:
    """``target(*args)`` for each ``args`` of ``calls``, each in a child forked from this process, all at once, on
    this process's stdout; returns how many children failed (a traceback printed for each), once all have exited.
    Past ``timeout`` seconds the children still running are killed and a ``TimeoutError`` says how many (a rank
    waiting for one that failed waits out its group's time-out)."""
    procs = _fork_calls(target, calls, None)
    return _failed(procs, _join(procs, timeout))


def forked_reports(target: Callable[..., Any], calls: Iterable[tuple],
                   timeout: float = 120) -> tuple[int, list[list[str]]]:
    """:func:`fork_ranks` from the test's own process, which has imported what the ranks run (no script started to
    import it again): each child's stdout is a pipe read here (pytest holds the test's). Returns how many children
    failed and their reports (:func:`reports`)."""
    deadline = time.monotonic() + timeout
    read, write = os.pipe()
    try:
        procs = _fork_calls(target, calls, write)
    finally:
        os.close(write)
    output = []
    with os.fdopen(read, "rb", buffering=0) as pipe:  # read as it comes: a full pipe would stop a child writing
        while select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = pipe.read(65536)
            if not chunk:  # the end of the file: every child has exited
                break
            output.append(chunk)
    killed = _join(procs, max(0.0, deadline - time.monotonic()))
    return _failed(procs, killed), reports(b"".join(output).decode(errors="replace"))


def report(*fields: object) -> None:
    """A rank's result as one marked line on the stdout the ranks share, in one write (a line printed in pieces could
    interleave with another's, or with what gloo and torch write there)."""
    os.write(1, f"{REPORT}{'|'.join(map(str, fields))}\n".encode())


def reports(output: str) -> list[list[str]]:
    """The fields of each rank's report in ``output``, the other lines left out."""
    return [line.removeprefix(REPORT).split("|") for line in output.splitlines() if line.startswith(REPORT)]


def _join(procs: list[multiprocessing.process.BaseProcess], timeout: float | None) -> int:
    """Waits for ``procs`` to end, ``timeout`` seconds at most for them all (``None``: as long as they run); kills
    those still running then. Returns how many it killed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    running = {proc.sentinel: proc for proc in procs}
    while running:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ended = multiprocessing.connection.wait(list(running), left)
        if not ended:
            break
        for sentinel in ended:
            running.pop(sentinel).join()
    for proc in running.values():
        # the test's captured stderr: where each process was held, and the threads of this process it was forked from
        # (a lock one of them held at the fork stays held in the child)
        print(f"this process's threads: {_thread_names()}\n{stacks_of_tree(proc.pid)}", file=sys.stderr)
        proc.kill()
        proc.join()
    return len(running)


def stacks_of_tree(pid: int) -> str:
    """``py-spy dump`` of ``pid`` and every process under it (a hung script's stack, and its stack's servers'): what a
    time-out kills would otherwise leave no trace of where it waited. Native frames for ``pid`` itself, where a lock
    inherited at the fork would hold it."""
    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    if spy is None:
        return f"(py-spy not installed: no stacks of process {pid} and its children)"
    dumps = []
    for member in _tree(pid):
        command = [spy, "dump", "--pid", str(member), *(["--native"] if member == pid else [])]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=30)
            dumps.append(f"--- py-spy dump of {member} (rc {done.returncode})\n{done.stdout}{done.stderr}")
        except subprocess.TimeoutExpired:
            dumps.append(f"--- py-spy dump of {member}: no answer in 30 s")
    return "\n".join(dumps)


def _thread_names() -> str:
    names = sorted(thread.name for thread in threading.enumerate())
    native = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else "?"
    return f"{native} native, Python's: {', '.join(names)}"


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, parents first (gone ones skipped)."""
    members, index = [pid], 0
    while index < len(members):
        members += process_children(members[index])
        index += 1
    return members


def _script_main(script: str, argv: list[str], env: dict[str, str], out: str | None, err: str) -> None:
    """In the child: ``script`` as ``__main__`` as a process of its own would run it: stdout to file ``out``
    (``None``: as it is) and stderr to ``err``, no logging handler of the parent's (pytest's: the script's
    ``basicConfig`` writes to stderr), ``env`` over the environment, ``argv``, the script's folder first on the
    path."""
    for fd, path in ((1, out), (2, err)):
        if path is None:
            continue
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - pytest's capture objects are the parent's
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    logging.getLogger().handlers.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # read again, from TMPDIR as env has it
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script` has it: what lies beside it
    runpy.run_path(script, run_name="__main__")


def _serve(script: str, argv: list[str], env: dict[str, str], stdin: multiprocessing.connection.Connection,
           stdout: multiprocessing.connection.Connection, err: str) -> None:
    """The child of :func:`start_script`: the pipes' descriptors as its stdin and stdout (multiprocessing gave it
    devnull for stdin), stderr to ``err``, then the script."""
    os.dup2(stdin.fileno(), 0)
    os.dup2(stdout.fileno(), 1)
    stdin.close()
    stdout.close()
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin, for its life
    _script_main(script, argv, env, None, err)


def _fork_calls(target: Callable[..., Any], calls: Iterable[tuple],
                stdout: int | None) -> list[multiprocessing.process.BaseProcess]:
    """One child per call, all forked before any begins. A rank that began at once met its group at the store this
    process hosts while the next rank was forked, so that fork could copy the store's server thread mid-answer, its
    locks held, into a child without that thread: a CI run had two ranks of a group idle until their time-out (0.9
    CPU-s in 121 s). Each child waits for the end of a pipe that closes once every child is forked."""
    go_read, go_write = os.pipe()
    try:
        return [_start("fork", partial(_rank, target, args, stdout, go_read, go_write), False) for args in calls]
    finally:
        os.close(go_write)
        os.close(go_read)


def _rank(target: Callable[..., Any], args: tuple, stdout: int | None, go_read: int, go_write: int) -> None:
    """A rank's child: ``target(*args)`` on ``stdout`` (``None``: the parent's), once every rank is forked."""
    os.close(go_write)
    os.read(go_read, 1)  # the end of the file: the parent and every rank closed their copies of the writing end
    os.close(go_read)
    if stdout is not None:
        os.dup2(stdout, 1)
    # a parent that ran OpenMP's thread pool leaves it unusable here: a parallel region would hang
    torch.set_num_threads(1)
    target(*args)


def _failed(procs: list[multiprocessing.process.BaseProcess], killed: int) -> int:
    if killed:
        raise TimeoutError(f"{killed} of {len(procs)} forked ranks still ran at their time-out: killed")
    return sum(proc.exitcode != 0 for proc in procs)


def _start(via: Via, body: Callable[[], None], exit_functions: bool) -> multiprocessing.process.BaseProcess:
    proc = _CONTEXTS[via].Process(target=_child, args=(body, exit_functions), daemon=via == "forkserver")
    proc.start()
    return proc


def _child(body: Callable[[], None], exit_functions: bool) -> NoReturn:
    """Every child's life: the inherited heap frozen, ``body``, its exit code, and (``exit_functions``) the exit
    functions ``body`` registered; then ``os._exit``, with nothing of the parent's torn down."""
    gc.freeze()
    code = 1
    if exit_functions:
        atexit._clear()  # the parent's: its business
    try:
        body()
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the child's traceback, for the test's failure message
        traceback.print_exc()
    finally:
        if exit_functions:
            atexit._run_exitfuncs()  # the script's own, failed or not
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
