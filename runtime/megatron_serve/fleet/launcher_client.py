"""The fleet's end of its launcher (:mod:`megatron_serve.commands.launcher`): start it when the first child is asked of it (and again once it
died), ask it to fork a child, and hold each forked child as a :class:`ForkedProcess`.

A forked child is not this process's child (it is the launcher's), so ``subprocess.Popen`` cannot hold it: a
:class:`ForkedProcess` has the part of Popen's surface the fleet uses (:class:`ChildProcess`), its exit status as the
launcher reports it, and its pidfd, by which it is signalled (a recycled pid is never hit). A thread of this object's
reads the launcher's reports. When the launcher dies, its children die with it (their parent-death signal): each one
still running is then waited for on its pidfd and reads as killed by SIGKILL, so the supervisor restarts it, and the
next start of a child starts a fresh launcher.
"""

from __future__ import annotations

import array
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Protocol

from ..wire.security import TOKEN_ENV
from ..processes.lifeline import LIFELINE_ENV, Lifeline

logger = logging.getLogger("megatron_serve.local_fleet")

#: Variables a child may hold with values of its own: read after the imports (by the command, by torch.distributed
#: at rendezvous, by CUDA at its first use), never at import. Any other difference means an exec.
LATE_READ = frozenset({TOKEN_ENV, LIFELINE_ENV, "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NPROC_PER_NODE",
                       "TORCHELASTIC_USE_AGENT_STORE", "CUDA_VISIBLE_DEVICES", "RANK"})
#: The largest request: a command line and an environment.
MAX_MESSAGE = 1 << 20
MAX_FDS = 16  # descriptors one child is passed (the lifeline, and a few more)
#: How a local fleet starts its engines and rendezvous stores: forked from its launcher, or each a fresh interpreter.
ENGINE_STARTS = ("fork", "exec")
#: Forked where the launcher can hold its children by pidfd (Linux 5.3 and later).
DEFAULT_ENGINE_START = "fork" if sys.platform.startswith("linux") and hasattr(os, "pidfd_open") else "exec"
#: How long a request waits for the launcher's answer: its first one waits for its imports (a few CPU-seconds, longer
#: on a loaded machine). Past it the launcher is ended and the child exec'd.
ANSWER_TIMEOUT = 120.0


class ChildProcess(Protocol):
    """What the fleet does with a child's process: ``subprocess.Popen``'s, or a :class:`ForkedProcess`'s."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class Refused(Exception):
    """The launcher cannot fork this child (the reason is the message): the fleet execs it instead."""


class ForkedProcess:
    """A child the launcher forked: ``subprocess.Popen``'s surface over its pidfd and the launcher's reports."""

    def __init__(self, args: list[str], pid: int, pidfd: int) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._lock = threading.Lock()  # a signal is never sent to a pidfd number closed (and reused) meanwhile
        self._ended = threading.Event()

    def _exited(self, returncode: int) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            self.returncode = returncode
            os.close(self._pidfd)
            self._pidfd = -1
        self._ended.set()

    def _wait_gone(self) -> None:
        """Block until the process has ended (its pidfd reads ready), whoever reaps it."""
        with self._lock:
            pidfd = os.dup(self._pidfd) if self.returncode is None else -1
        if pidfd >= 0:
            try:
                select.select([pidfd], [], [])
            finally:
                os.close(pidfd)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self.returncode is None:
                try:
                    signal.pidfd_send_signal(self._pidfd, sig)
                except ProcessLookupError:  # it exited; the launcher's report is on its way
                    pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Launcher:
    """Forks the fleet's children from its launcher process (started on first use, on the calling thread: the
    supervisor's, which the launcher's parent-death signal follows)."""

    def __init__(self, lifeline: Lifeline, log: Path | None) -> None:
        """``log``: its output (None: this process's). It runs this process's interpreter, and forks only its
        commands."""
        self.lifeline, self.log = lifeline, log
        self.proc: subprocess.Popen | None = None
        self._channel: socket.socket | None = None
        self._answers: list[ForkedProcess | str] = []  # what the launcher answered: a child, or why not
        self._answered = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}  # pid -> process, until it exits
        self._reader: threading.Thread | None = None
        self._closed = False

    def spawn(self, argv: list[str], env: dict[str, str], log: Path | None, pass_fds: tuple[int, ...] = ()
              ) -> ForkedProcess:
        """Fork ``argv`` with ``env`` (the lifeline's variable and descriptor added), its output to ``log``, the
        descriptors ``pass_fds`` at their numbers; raises :class:`Refused` where it cannot."""
        if self._closed:
            raise Refused("the fleet has ended")
        if argv[:1] != [sys.executable]:
            raise Refused(f"its interpreter {argv[:1]} is not the launcher's {sys.executable}")
        fds = (*self.lifeline.pass_fds(), *pass_fds)
        if len(fds) > MAX_FDS:
            raise Refused(f"{len(fds)} descriptors to pass (at most {MAX_FDS})")
        channel = self._running(env)
        assert self.proc is not None
        request = {"argv": argv, "env": {**env, **self.lifeline.env(parent=self.proc.pid)},
                   "log": str(log) if log is not None else None, "fds": list(fds)}
        data = json.dumps(request).encode()
        if len(data) > MAX_MESSAGE:
            raise Refused(f"a request of {len(data)} bytes (at most {MAX_MESSAGE})")
        with self._answered:
            try:
                channel.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])
            except OSError as exc:
                raise Refused(f"the launcher is gone ({exc})") from exc
            answered = self._answered.wait_for(lambda: bool(self._answers) or self._channel is not channel,
                                               ANSWER_TIMEOUT)
            answer = self._answers.pop(0) if self._answers else None
        if not answered:
            self._end(f"it did not answer within {ANSWER_TIMEOUT:.0f}s")
        if answer is None:
            raise Refused(f"the launcher (pid {self.proc.pid}) ended: {self._cause()}")
        if isinstance(answer, str):
            raise Refused(answer)
        answer.args = argv
        return answer

    def start(self, env: dict[str, str]) -> None:
        """Start the launcher now with the fleet's environment ``env``, if it is not running (its imports then overlap
        what the fleet starts meanwhile)."""
        if not self._closed:
            self._running(env)

    def close(self) -> None:
        """End the launcher (its children are ended first, by the fleet); nothing is forked after this."""
        self._closed = True
        self._end(None)

    # ------------------------------------------------------------------ its process

    def _running(self, env: dict[str, str]) -> socket.socket:
        """The channel of a launcher that runs: the one there is, or a fresh one with ``env`` (the environment its
        imports run with, which a child's may differ from only in :data:`LATE_READ`: the fleet's, or the child's that
        it is started for)."""
        if self._channel is not None and self.proc is not None and self.proc.poll() is None:
            return self._channel
        if self._reader is not None:
            self._reader.join()  # it saw the old one's end: its children are accounted for
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        output = open(self.log, "ab") if self.log is not None else None
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "megatron_serve.commands.launcher", "--socket", str(theirs.fileno())],
                stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT if output is not None else None,
                env={**env, **self.lifeline.env()}, start_new_session=True,
                pass_fds=(*self.lifeline.pass_fds(), theirs.fileno()))
        finally:
            theirs.close()
            if output is not None:
                output.close()
        logger.info("engine launcher started (pid %d): engines and rendezvous stores are forked from it",
                    self.proc.pid)
        self._channel = ours
        self._reader = threading.Thread(target=self._read, args=(ours,), name="megatron-serve-launcher", daemon=True)
        self._reader.start()
        return ours

    def _end(self, why: str | None) -> None:
        """Stop the launcher: close its channel (it exits), then SIGKILL what is left; ``why``: logged, if any."""
        channel, proc = self._channel, self.proc
        if channel is None or proc is None:
            return
        if why is not None:
            logger.warning("engine launcher (pid %d): %s: ending it", proc.pid, why)
        try:
            channel.shutdown(socket.SHUT_RDWR)  # it exits, and its reader here sees the end
        except OSError:  # the reader closed it: the launcher ended
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self._reader is not None:
            self._reader.join()

    def _cause(self) -> str:
        code = None if self.proc is None else self.proc.poll()
        return "still running" if code is None else (f"exit code {code}" if code >= 0 else
                                                     f"killed by {signal.Signals(-code).name}")

    def _read(self, channel: socket.socket) -> None:
        """The reports of the launcher on ``channel``, until it ends; then its children's ends, as they come."""
        while True:
            try:
                data, ancillary, _, _ = channel.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(4))
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            if "exited" in message:
                process = self._children.pop(message["exited"], None)
                if process is not None:
                    process._exited(message["returncode"])
                continue
            received = array.array("i")
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    received.frombytes(payload[:len(payload) - len(payload) % received.itemsize])
            answer: ForkedProcess | str = message.get("refused", "")
            if "pid" in message:  # held from now on: its end is reported after this, and may come at once
                answer = self._children[message["pid"]] = ForkedProcess([], message["pid"], received[0])
            with self._answered:
                self._answers.append(answer)
                self._answered.notify_all()
        with self._answered:
            self._channel = None
            self._answered.notify_all()
        channel.close()
        if self.proc is not None:
            try:
                self.proc.wait(10)  # it exits at its channel's end, or has
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        orphans = list(self._children.values())
        self._children.clear()
        if orphans and not self._closed:
            logger.warning("engine launcher (pid %d) died (%s): its %d child(ren) die with it and are restarted",
                           self.proc.pid if self.proc else -1, self._cause(), len(orphans))
        for process in orphans:  # killed by their parent-death signal: wait until each has
            process._wait_gone()
            process._exited(-signal.SIGKILL)
