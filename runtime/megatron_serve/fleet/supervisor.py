"""The local fleet's process supervisor: one thread starts, watches and restarts its children.

Like a StatefulSet's pods (or systemd's ``Restart=on-failure``): a child that dies of a signal or
with a non-zero exit code is started again with the same command line, after a back-off that
doubles from ``initial`` to ``maximum`` and starts over once a child has run for ``stable``
seconds, and each restart is logged with its cause. A child that exits 0 did what it was asked
(STOP, or a drain after SIGTERM) and is left alone. A child with a liveness check (:attr:`Child.hung`: the
coordinator's, :mod:`.coordinator_watch`) that finds it hung is killed and restarted the same way. Before, a killed engine left the fleet at half
its capacity with nothing in any log, and a killed coordinator was never replaced.

A :class:`Gang` (the attention ranks of one data-parallel group: engines whose MoE layers' collectives
span all of them) lives and dies as one, as the operator's gangs do: when one member dies, the others
(and their tensor-parallel worker processes, which share their process group) are killed and waited
for, the gang is given a fresh rendezvous, and every member starts again together. Restarted one by one,
the ranks would come back to the old port each after its own back-off (a peer that has not yet noticed
the loss, e.g. one stuck in a step, would not be restarted at all), while processes of the old gang might
still hold that port. A gang of an elastic expert group (``InferenceConfig.elastic_expert_group``: its ranks serve
on without a lost one, and a rank's restart joins them in place, ``engine/group/membership.py``) restarts only the
member it lost, as a child of its own, unless that member is the first, whose process hosts the rendezvous store
the others meet in: then the gang restarts as above. A gang with a store of its own (:attr:`Gang.store`, a
``rendezvous-store`` process that no engine's loss takes) restarts its first member alone too; it restarts as a whole,
with a fresh store, only when the store is lost or no member is left serving (a restart alone would find no group to
join). Such a member that exits 0 (``scale-ep`` took it out) stays
out until the group is wanted at a size above its rank again (:meth:`Supervisor.want_ranks`, told by ``run``, which
reads the size in the coordinator's STATUS): then it starts again and joins, as a lost rank's restart does.

Every child is started on the supervisor's own thread, never the caller's: the parent-death signal
(:mod:`megatron_serve.processes.lifeline`) follows the thread that started a child, and a caller's worker
thread may end long before the fleet does.

A child marked :attr:`Child.fork` (an engine, a rendezvous store: the processes that import torch) is forked by the
fleet's launcher (:mod:`megatron_serve.commands.launcher`, started here on the supervisor's thread when the first such child starts, and
again after it died), else, or where the launcher refuses it, exec'd. The deaths: the fleet's process dies -> the
launcher and every child die (each one's parent-death signal and lifeline); the launcher dies -> the children it forked
die with it (their parent-death signal follows it) and are restarted here as any dead child, through a fresh
launcher; a forked child dies -> restarted through the launcher, a fork instead of a fresh interpreter's imports.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .launcher_client import ChildProcess, Launcher, Refused
from ..processes.lifeline import Lifeline

logger = logging.getLogger("megatron_serve.local_fleet")


@dataclass(eq=False)
class Child:
    """One supervised process: how to start it, and what became of it."""

    name: str  # for the log: "coordinator", "engine 1 (group 1)"
    argv: list[str]
    log: Path | None  # None: the parent's standard output and error
    env: dict[str, str]
    pass_fds: tuple[int, ...] = ()  # descriptors it inherits besides the lifeline (an API server's listening socket)
    proc: ChildProcess | None = None
    fork: bool = False  # forked by the fleet's launcher where it can (it imports torch), else exec'd
    started: float = 0.0
    delay: float = 0.0  # the back-off before its next restart
    restart_at: float | None = None  # when it is due to start again (it died)
    retired: bool = False  # exited 0 (meant to: a drain, a STOP, a scale-ep): not started again unless wanted
    retired_at: float = 0.0  # when it was found retired (monotonic): a size read before then predates its exit
    causes: list[str] = field(default_factory=list)  # why it was restarted, in order
    gang: "Gang | None" = None  # the children it lives and dies with
    # its liveness check: why it counts as hung at ``now`` given when it started, or None (None: exits only)
    hung: Callable[[float, float], str | None] | None = None


@dataclass(eq=False)
class Gang:
    """Children started, ended and restarted together; ``renew`` runs before each start (a fresh rendezvous)."""

    name: str  # for the log: "group 0"
    members: list[Child]
    renew: Callable[[], None]
    elastic: bool = False  # members after the first serve on without a lost one, which restarts alone and joins
    store: Child | None = None  # its rendezvous store's own process (started before the members): any member may go
    started: float = 0.0
    delay: float = 0.0
    restart_at: float | None = None


def exit_cause(returncode: int) -> str:
    """``-9`` -> ``killed by SIGKILL``; ``1`` -> ``exit code 1``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def log_tail(path: Path, lines: int) -> str | None:
    """The last ``lines`` lines of a child's log, read from its end only (None: no log to read)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(path) - 64 * 1024))
            text = fh.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return None
    return "\n".join(text[-lines:])


class Supervisor:
    """Starts children on its thread (:meth:`start_child`); restarts dead ones once :meth:`restart_dead` is on."""

    def __init__(self, lifeline: Lifeline, *, launcher: Launcher | None = None, initial: float = 0.5,
                 maximum: float = 30.0, stable: float = 60.0, poll: float = 0.1) -> None:
        """``launcher``: what forks the children marked :attr:`Child.fork` (None: every child is exec'd)."""
        self.lifeline = lifeline
        self.launcher = launcher
        self.initial, self.maximum, self.stable, self.poll = initial, maximum, stable, poll
        self.children: list[Child] = []
        self.gangs: list[Gang] = []
        self.restarting = False
        self._calls: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...], concurrent.futures.Future]] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="megatron-serve-supervisor", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ from any thread

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the supervisor's thread and return what it returns (or raise what it raises)."""
        if self._closed or threading.current_thread() is self._thread:
            return fn(*args)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, args, future))
        return future.result()

    def start_child(self, child: Child) -> ChildProcess:
        """Start ``child`` (on the supervisor's thread) and watch it from now on."""
        return self.call(self._start, child)

    def start_gang(self, gang: Gang) -> list[ChildProcess]:
        """Start every member of ``gang`` (after its ``renew``) and watch them as one from now on."""
        return self.call(self._start_gang, gang)

    def start_launcher(self, env: dict[str, str]) -> None:
        """Start the launcher (if any) now, on this thread, with the environment ``env``, ahead of the first child it
        forks."""
        if self.launcher is not None:
            self.call(self.launcher.start, env)

    def want_ranks(self, gang: Gang, size: int, read_at: float) -> None:
        """``gang``'s elastic group is wanted at ``size`` ranks, as read (asked for) at ``read_at`` (monotonic):
        its members below that rank that exited 0 before then start again, on the gang's rendezvous, and join."""
        self.call(self._want, gang, size, read_at)

    def restart_dead(self, on: bool) -> None:
        """Turn restarts on or off; once this returns with ``on=False``, nothing is started again."""
        self.call(setattr, self, "restarting", on)

    def close(self) -> None:
        """Stop the thread and the launcher (children are left as they are: end them first)."""
        if not self._closed:
            self.restart_dead(False)
            self._closed = True
            self._calls.put((lambda: None, (), concurrent.futures.Future()))
            self._thread.join(10)
            if self.launcher is not None:
                self.launcher.close()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._closed:
            try:
                fn, args, future = self._calls.get(timeout=self.poll)
            except queue.Empty:
                pass
            else:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args))
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        future.set_exception(exc)
            if self.restarting:
                self._check(time.monotonic())

    def _start(self, child: Child) -> ChildProcess:
        child.proc = self._fork(child) if child.fork and self.launcher is not None else None
        if child.proc is None:
            child.proc = self._exec(child)
        child.started, child.restart_at = time.monotonic(), None
        if child not in self.children:
            self.children.append(child)
        return child.proc

    def _fork(self, child: Child) -> ChildProcess | None:
        """``child`` forked by the launcher, or None where it refuses (said in the log: it is exec'd)."""
        assert self.launcher is not None
        try:
            return self.launcher.spawn(child.argv, child.env, child.log, child.pass_fds)
        except Refused as why:
            logger.warning("%s: the launcher cannot fork it (%s): starting it as a fresh process", child.name, why)
            return None

    def _exec(self, child: Child) -> subprocess.Popen:
        log = open(child.log, "ab") if child.log is not None else None
        try:
            return subprocess.Popen(child.argv, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT if log is not None else None,
                                    env={**child.env, **self.lifeline.env()}, start_new_session=True,
                                    pass_fds=(*self.lifeline.pass_fds(), *child.pass_fds))
        finally:
            if log is not None:
                log.close()

    def _start_gang(self, gang: Gang) -> list[ChildProcess]:
        gang.renew()
        if gang.store is not None:  # a fresh store: the old one holds the old group's records
            end_process_group(gang.store.proc)
            gang.store.gang = gang  # restarted with its gang, never alone
            self._start(gang.store)
        procs = []
        for child in gang.members:
            child.gang, child.retired = gang, False
            procs.append(self._start(child))
        gang.started, gang.restart_at = time.monotonic(), None
        if gang not in self.gangs:
            self.gangs.append(gang)
        return procs

    def _want(self, gang: Gang, size: int, read_at: float) -> None:
        if not (self.restarting and gang.elastic and gang.restart_at is None):
            return
        for child in gang.members[:size]:
            if child.retired and child.retired_at < read_at:
                child.retired = False
                child.causes.append(f"its group is wanted at {size} ranks")
                logger.warning("%s: %s is wanted at %d ranks: starting it again; it joins the ranks that serve",
                               child.name, gang.name, size)
                self._start(child)

    def _check(self, now: float) -> None:
        for gang in self.gangs:
            self._check_gang(gang, now)
        for child in self.children:
            if child.retired or child.proc is None or child.gang is not None:
                continue
            if child.restart_at is not None:
                if now >= child.restart_at:
                    self._start(child)
                continue
            code = child.proc.poll()
            if code is None:
                reason = None if child.hung is None else child.hung(child.started, now)
                if reason is not None:  # killed and started again as a dead one is
                    logger.warning("%s is hung (%s): killing it", child.name, reason)
                    end_process_group(child.proc)
                    self._schedule(child, child.proc.returncode, now, f"; it was hung: {reason}")
                continue
            if code == 0:
                child.retired = True
                logger.warning("%s exited normally (exit code 0): it is not restarted", child.name)
                continue
            self._schedule(child, code, now)

    def _schedule(self, child: Child, code: int, now: float, why: str = "") -> None:
        """``child`` died with ``code``: start it again after its back-off, saying so."""
        uptime = now - child.started
        child.delay = self._back_off(child.delay, uptime)
        child.restart_at = now + child.delay
        cause = exit_cause(code)
        child.causes.append(cause)
        said = (log_tail(child.log, 1) or "").strip() if code > 0 and child.log is not None else ""
        logger.warning("%s died (%s after %.0fs%s): restarting it in %.1fs%s (restart %d; log: %s)", child.name,
                       cause, uptime, f"; its last line: {said}" if said else "", child.delay, why,
                       len(child.causes), child.log or "above")

    def _check_gang(self, gang: Gang, now: float) -> None:
        if gang.restart_at is not None:
            if now >= gang.restart_at:
                self._start_gang(gang)
            return
        dead = []
        for child in gang.members:
            if child.restart_at is not None:  # an elastic gang's member, restarting alone
                if now >= child.restart_at:
                    self._start(child)
                continue
            code = None if child.retired or child.proc is None else child.proc.poll()
            if code == 0:
                child.retired, child.retired_at = True, time.monotonic()
                logger.warning("%s exited normally (exit code 0): it is not restarted", child.name)
            elif code is not None:
                dead.append((child, code))
        store_code = None if gang.store is None or gang.store.proc is None else gang.store.proc.poll()
        if store_code is not None:
            dead.append((gang.store, store_code))
        if not dead:
            return
        if gang.elastic and store_code is None and self._alone(gang, [child for child, _ in dead]):
            for child, code in dead:
                end_process_group(child.proc)  # its tensor-parallel workers, if any
                self._schedule(child, code, now, ", alone: it joins the ranks that serve on")
            return
        for child in gang.members:  # the peers (which exit on their own once a collective fails) and their workers
            end_process_group(child.proc)
        if gang.store is not None:
            end_process_group(gang.store.proc)
        uptime = now - gang.started
        gang.delay = self._back_off(gang.delay, uptime)
        gang.restart_at = time.monotonic() + gang.delay
        lost = ", ".join(f"{child.name}: {exit_cause(code)}" for child, code in dead)
        for child in gang.members:
            child.causes.append(next((exit_cause(code) for c, code in dead if c is child), f"its gang lost {lost}"))
        logger.warning("%s lost %s (after %.0fs); every rank of it and their workers ended: restarting the gang "
                       "with a fresh rendezvous in %.1fs (restart %d)", gang.name, lost, uptime, gang.delay,
                       len(gang.members[0].causes))

    def _back_off(self, delay: float, uptime: float) -> float:
        """The wait before a restart, after ``delay`` before the last one and ``uptime`` since it: the first wait
        again after a stable run, else twice the last one up to the maximum (a child's and a gang's alike)."""
        return self.initial if uptime >= self.stable or not delay else min(delay * 2, self.maximum)

    @staticmethod
    def _alone(gang: Gang, dead: list[Child]) -> bool:
        """Whether an elastic gang's ``dead`` members restart alone and join the others: a member still serves, and
        the rendezvous store outlived them (it has a process of its own, or the first member is not among them)."""
        serving = any(child.proc is not None and child.proc.poll() is None for child in gang.members)
        return serving and (gang.store is not None or gang.members[0] not in dead)


def end_process_group(proc: ChildProcess | None, timeout: float = 30.0) -> None:
    """SIGKILL ``proc``'s process group (a child started in a session of its own: it and the worker processes it
    spawned) and wait until no process of it runs, up to ``timeout`` seconds."""
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.monotonic() + timeout
    while group_running(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if group_running(proc.pid):
        logger.error("process group %d still runs %.0fs after SIGKILL", proc.pid, timeout)


def stop_process_group(proc: subprocess.Popen, first: signal.Signals = signal.SIGINT, timeout: float = 60.0) -> None:
    """Stop ``proc``'s process group (a child started in a session of its own) as a user does: ``first`` to the group
    (a terminal's Ctrl-C, or a pod's stop), ``timeout`` seconds to exit, then SIGKILL to the group. Nothing to do if
    it already exited. What the tests and the benchmarks stop the ``megatron-serve`` commands they start with."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, first)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` runs (zombies, awaiting their reaping by init, do not count)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
