"""A local fleet's launcher: one process that imported torch and the engine command's modules once, and forks the
fleet's ``engine`` and ``rendezvous-store`` processes from there (``python -m megatron_serve.commands.launcher
--socket FD``; the fleet's end: :mod:`megatron_serve.fleet.launcher_client`).

Why: nearly all of an engine process's CPU on its way to serving is ``import torch``, paid again by every engine,
every rank of a gang, every rendezvous store and every restart. Forked from a process that
paid it once, a child starts where an exec'd one would be after its imports (a zygote, as multiprocessing's fork
server and Android's zygote do). The coordinator, the API servers and the janitor import no torch and are still
exec'd. Figures: docs/design-measurements.md.

A fork is as safe as an exec only from a process in which nothing but imports ran: this one stays single-threaded
(no thread of any kind, native ones included: a lock another thread held would stay held in the child for good),
never initializes CUDA, configures no logging and changes no signal disposition; it checks the first two before each
fork and refuses otherwise, and the fleet then execs the child as before. A child whose environment differs from the
launcher's in a variable other than :data:`~megatron_serve.fleet.launcher_client.LATE_READ` is refused too: torch,
OpenMP and the interpreter read those at import, so a fork would run the child with the launcher's values.

The child becomes what an exec would have made (:func:`become`): a session of its own, the interpreter's signal
dispositions and an empty signal mask, stdin ``/dev/null``, stdout and stderr to its log, exactly the descriptors it
was sent (renumbered to the numbers its environment names, e.g. the lifeline's), its environment replaced, a process
title (``setproctitle``, as vLLM and Ray name their workers) that makes ``ps`` and ``/proc/PID/cmdline`` read as
its command line; then the CLI's ``main`` and ``os._exit`` with its code. The launcher reaps its children and reports
each one's pid and exit status to the fleet.

Deaths: the launcher holds the fleet's lifeline as every child does (the parent-death signal and the pipe, watched
here in the one loop, not in a thread), so it dies with the fleet; its children arm their parent-death signal against
it, so they die with it. The fleet restarts them (and a fresh launcher) as it restarts any dead child.

The wire: a ``SOCK_SEQPACKET`` socket pair, one JSON message per packet. A request ``{"argv", "env", "log", "fds"}``
carries the descriptors by ``SCM_RIGHTS`` in the order of ``fds`` (their numbers in the child); its answer is
``{"pid"}`` with the child's pidfd (the fleet signals and watches it by that, immune to a recycled pid), or
``{"refused": why}``. ``{"exited": pid, "returncode": code}`` follows each child's end (``subprocess``'s code: minus
the signal that killed it).
"""

from __future__ import annotations

import array
import atexit
import ctypes
import fcntl
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import traceback
from typing import Callable

import setproctitle

from ..fleet.launcher_client import LATE_READ, MAX_FDS, MAX_MESSAGE
from ..processes.lifeline import arm_lifeline, wait_for_end_of_file

#: The interpreter's signal dispositions, as they were before any import: what each child starts with.
SIGNALS = {signum: signal.getsignal(signum) for signum in signal.valid_signals()
           if signum not in (signal.SIGKILL, signal.SIGSTOP)}
#: What it imports once for every child: the engine command's module first (it sets OMP_WAIT_POLICY before torch, and
#: with it OpenMP, is imported, as an exec'd engine does), then what the commands import when they run.
PRELOAD = ["megatron_serve.commands.engine", "megatron_serve.cli", "megatron_serve.commands.rendezvous_store",
           "torch", "torch.distributed", "megatron_serve.engine", "megatron_serve.engine.group.spawn",
           "megatron_serve.engine.process.loop", "megatron_serve.wire.transport"]
#: The command line of every child it forks, less the command's own arguments.
CLI = [sys.executable, "-m", "megatron_serve.cli"]


def environment_difference(env: dict[str, str], base: dict[str, str]) -> list[str]:
    """The variables outside :data:`LATE_READ` in which ``env`` differs from ``base`` (one set, unset, or changed)."""
    return sorted(name for name in env.keys() | base.keys()
                  if name not in LATE_READ and env.get(name) != base.get(name))


def refusal(argv: list[str], env: dict[str, str], base: dict[str, str]) -> str | None:
    """Why this process cannot fork a child for ``argv`` with ``env`` now (None: it can). ``base``: this process's
    environment, its imports' defaults set (``OMP_WAIT_POLICY``), which an exec'd child's would get as well."""
    if argv[:3] != CLI or len(argv) < 4:
        return f"its command is not `{' '.join(CLI)} COMMAND`: {' '.join(argv[:4])}"
    from .engine import IMPORT_DEFAULTS  # noqa: PLC0415 - preloaded by main()

    differ = environment_difference({**IMPORT_DEFAULTS, **env}, base)
    if differ:
        return f"its environment differs from the launcher's in {', '.join(differ)}, read when torch is imported"
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        return f"the launcher runs {threads} threads (a fork copies one: a lock another held stays held)"
    if sys.modules["torch"].cuda.is_initialized():
        return "the launcher initialized CUDA, which a forked child cannot use"
    return None


def become(argv: list[str], env: dict[str, str], log: str | None, targets: list[int], fds: list[int],
           channel: socket.socket) -> None:
    """In the forked child: turn into the process an exec of ``argv`` would have started, run its command and exit
    with its code. Never returns."""
    from .. import cli  # noqa: PLC0415 - preloaded by main()
    from .engine import IMPORT_DEFAULTS  # noqa: PLC0415

    code = 1
    try:
        os.setsid()
        for signum, handler in SIGNALS.items():
            if signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        channel.detach()  # its number is closed below; the object must never close a reused one
        stdin = os.open(os.devnull, os.O_RDONLY)
        output = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if log is not None else None
        lowest = max([2, *targets]) + 1  # out of the way of every number the child names
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, lowest) for fd in fds]
        os.dup2(stdin, 0)
        if output is not None:
            os.dup2(output, 1)
            os.dup2(output, 2)
        for fd, target in zip(moved, targets):
            os.dup2(fd, target)
        _close_all_but({0, 1, 2, *targets})
        os.environ.clear()
        os.environ.update(env)
        for name, value in IMPORT_DEFAULTS.items():  # what the launcher's imports ran with
            os.environ.setdefault(name, value)
        sys.argv = [cli.__file__, *argv[3:]]
        setproctitle.setproctitle(" ".join(argv))
        if "numpy" in sys.modules:  # an exec'd child seeds numpy's global generator afresh (random reseeds itself)
            sys.modules["numpy"].random.seed()
        code = run_command(cli.main, argv[3:])
        atexit._run_exitfuncs()  # as the interpreter's exit would
    except BaseException:  # noqa: BLE001 - the child ends here whatever happened
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def run_command(main: Callable[[list[str]], int], args: list[str]) -> int:
    """``megatron-serve ARGS``' exit code, as ``sys.exit(main())`` would make it."""
    try:
        return int(main(args) or 0)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1


def _close_all_but(keep: set[int]) -> None:
    for fd in sorted(int(name) for name in os.listdir("/proc/self/fd")):
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def stop_blas_threads() -> None:
    """Stop OpenBLAS's thread pool (numpy's, which torch imports), started at its load with a thread per core unless
    ``OMP_NUM_THREADS``/``OPENBLAS_NUM_THREADS`` say 1: what OpenBLAS's own ``pthread_atfork`` handler does before
    every fork, so those threads are no hazard, but this process's single thread is then what :func:`refusal` sees.
    The pool starts again at a child's first BLAS call."""
    with open("/proc/self/maps") as maps:
        libraries = {line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1]}
    for path in libraries:
        try:
            ctypes.CDLL(path).blas_thread_shutdown_()
        except (OSError, AttributeError):
            continue


class Launcher:
    """The launcher's loop: requests from the fleet, its children's ends, and the fleet's lifeline, in one thread."""

    def __init__(self, channel: socket.socket, lifeline: int | None) -> None:
        self.channel = channel
        self.lifeline = lifeline
        self.base = dict(os.environ)  # the fleet's, as this process was started with it (its lifeline popped)
        self.children: dict[int, int] = {}  # pidfd -> pid
        self.poller = select.poll()
        self.poller.register(channel, select.POLLIN)
        if lifeline is not None:
            self.poller.register(lifeline, select.POLLIN)

    def serve(self) -> None:
        """Until the fleet closes its end, or the fleet's process is gone (its lifeline reads end-of-file)."""
        while True:
            for fd, _ in self.poller.poll():
                if fd == self.lifeline:
                    wait_for_end_of_file(fd)  # readable only at its end: the fleet never writes
                    return
                if fd == self.channel.fileno():
                    if not self._request():
                        return
                else:
                    self._reap(fd)

    def _request(self) -> bool:
        data, ancillary, _, _ = self.channel.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(MAX_FDS * 4))
        if not data:
            return False
        fds = array.array("i")
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        try:
            request = json.loads(data)
            self._answer(request, list(fds))
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def _answer(self, request: dict, fds: list[int]) -> None:
        argv, env, log, targets = request["argv"], request["env"], request["log"], request["fds"]
        if len(targets) != len(fds) or any(target < 3 for target in targets):
            self._send({"refused": f"{len(fds)} descriptors for the numbers {targets} (each 3 or more)"})
            return
        why = refusal(argv, env, self.base)
        if why is not None:
            self._send({"refused": why})
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            become(argv, env, log, targets, fds, self.channel)
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = pid
        self.poller.register(pidfd, select.POLLIN)
        self._send({"pid": pid}, [pidfd])

    def _reap(self, pidfd: int) -> None:
        pid = self.children.pop(pidfd)
        self.poller.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        self._send({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})

    def _send(self, message: dict, fds: list[int] = ()) -> None:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
        try:
            self.channel.sendmsg([json.dumps(message).encode()], ancillary)
        except OSError:  # the fleet is gone; its lifeline ends this process
            pass


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "--socket" or not argv[1].isdigit():
        print(f"usage: python -m megatron_serve.commands.launcher --socket FD (got {' '.join(argv)})", file=sys.stderr)
        return 2
    # setproctitle finds the memory a title may take (the command line's, then the environment's, which it moves) at
    # its first call, and a child replaces its environment before it names itself: so here, once, for every child
    setproctitle.setproctitle(setproctitle.getproctitle())
    lifeline = arm_lifeline()
    channel = socket.socket(fileno=int(argv[1]))
    for name in PRELOAD:
        importlib.import_module(name)
    stop_blas_threads()
    gc.freeze()  # what the imports made stays out of every collection: shared with the children, page for page
    Launcher(channel, lifeline).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
