"""Child processes that die with their parent, whatever kills it.

A ``megatron-serve run`` killed with ``kill -9`` (or ended by a broken pipe) left its coordinator and
engines running under PID 1, 1.5 GB and the coordinator's port with them: the next ``run`` failed
with "Address already in use". Two mechanisms, as systemd and Kubernetes' kubelet use them:

* the **parent-death signal** (Linux ``prctl(PR_SET_PDEATHSIG)``): the kernel sends SIGKILL to the
  child when the *thread* that started it ends, which covers SIGKILL of the parent and needs no
  cooperation from the child (a child stuck in a long C call dies too). Because it follows a
  thread, the parent must start its children from a thread that lives as long as they should
  (:class:`~megatron_serve.fleet.supervisor.Supervisor` does, and the engine's fork server for its ranks);
* a **lifeline pipe**, for other systems and as a second line: the parent holds the write end of
  a pipe and never writes; each child watches the read end in a thread and exits when it reads
  end-of-file, which the kernel delivers once no process holds the write end any more.

The parent side is :class:`Lifeline`; a child calls :func:`hold_lifeline` first thing (the
``megatron-serve`` entry point does), which reads the pipe's descriptor and the parent's PID from
``$MEGATRON_SERVE_LIFELINE`` and removes the variable, so grandchildren do not watch a pipe that is
not theirs.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

LIFELINE_ENV = "MEGATRON_SERVE_LIFELINE"
#: The name of a child's watching thread. It only ever blocks in ``read`` and holds no lock, so a fork taken while it
#: runs is as safe as one taken with no thread (the engine command forks its ranks so: engine.group.spawn).
WATCH_THREAD = "megatron-serve-lifeline"
_PR_SET_PDEATHSIG = 1


def parent_death_signal(signum: signal.Signals = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``signum`` to this process when the thread that started it ends (Linux only);
    returns whether it could."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class Lifeline:
    """The parent's end: children started with :meth:`env` and :meth:`pass_fds` exit when this process does,
    or when :meth:`close` is called."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()  # neither is inherited, except the read end where passed

    def env(self, parent: int | None = None) -> dict[str, str]:
        """A child's variable naming the pipe and its parent: this process, or ``parent`` (a launcher that forks it,
        :mod:`megatron_serve.commands.launcher`), whose thread its parent-death signal follows."""
        return {LIFELINE_ENV: f"{self._read}:{parent or os.getpid()}"}

    def pass_fds(self) -> tuple[int, ...]:
        return (self._read,)

    def close(self) -> None:
        """Cut the lifeline: every child still holding it exits."""
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
        self._read = self._write = -1


def hold_lifeline() -> None:
    """In a child started with a :class:`Lifeline`: die with the parent (nothing to do without one)."""
    fd = arm_lifeline()
    if fd is not None:
        threading.Thread(target=_watch, args=(fd,), name=WATCH_THREAD, daemon=True).start()


def arm_lifeline() -> int | None:
    """The parent-death signal armed and the lifeline's descriptor, for a child that watches it itself (the
    launcher, which must stay single-threaded); None without a lifeline."""
    value = os.environ.pop(LIFELINE_ENV, None)
    if not value:
        return None
    fd_text, _, pid_text = value.partition(":")
    fd, parent = int(fd_text), int(pid_text)
    parent_death_signal()
    if os.getppid() != parent:  # the parent died before the signal was armed
        _parent_gone()
    return fd


def _watch(fd: int) -> None:
    wait_for_end_of_file(fd)
    _parent_gone()


def wait_for_end_of_file(fd: int) -> None:
    """Block until the pipe's read end ``fd`` reads end-of-file (or fails): the kernel's word that no process holds
    the write end any more. The children's lifeline waits on one so."""
    while True:
        try:
            if not os.read(fd, 1):
                return
        except InterruptedError:
            continue
        except OSError:
            return


def _parent_gone() -> None:
    try:
        os.write(2, f"megatron-serve (pid {os.getpid()}): the parent process is gone: exiting\n".encode())
    finally:
        os._exit(1)

