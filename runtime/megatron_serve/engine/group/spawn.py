"""Starting a group from rank 0's process (:func:`start_rank_zero`): this machine's other ranks as child processes
(:func:`spawn_local_workers`, each running :func:`.follower.run_worker`), then joining the group; and leaving it when
the start fails after it formed (:func:`abandon_group`).

The ranks come from multiprocessing's fork server, which imports torch and the follower's modules once (:data:`PRELOAD`)
and forks every rank from there: a fresh interpreter per rank spent most of its start importing torch, again for each
rank and again for each group a process starts. A fork server starts clean (nothing has run on its threads), so
forking it is as safe as spawning; each rank still imports the parent's ``__main__`` as a spawned one would, and takes
rank 0's environment as it is when the rank starts (the fork server keeps the one it started with).

The ``engine`` command's process forks its ranks itself instead (:func:`fork_ranks_here`): its ``__main__`` is the
command's, and when its group starts nothing has run in it but argument parsing, logging and (in a local fleet) the
lifeline's watch, so the fork server's interpreter and its torch import (most of a rank's start) buy nothing there."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.synchronize
import os
import shutil
import socket
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from ...config import InferenceConfig
from ...model.parallel import TensorParallel
from ...processes.lifeline import WATCH_THREAD
from .channel import PlanChannel
from .follower import run_worker
from .membership import running
from .placement import (RENDEZVOUS_TIMEOUT_S, Placement, check_local_devices, client_store, data_parallel_placement,
                        host_store, join_group, joiner_groups, placement_for, rank_device, reserve_rendezvous,
                        store_hosted_elsewhere)

#: The exit code of a rank's process that found itself re-running its parent's script (see reimported_main).
REIMPORTED_MAIN_EXIT = 3
GUARD_HINT = ("a script that builds a tensor-parallel engine (LLM(..., tensor_parallel_size=N) and the like) must "
              "do so under `if __name__ == \"__main__\":`: each other rank's process is started by "
              "multiprocessing's fork server, which imports the script again, so that code at its top level runs "
              "again there")

#: What the fork server imports before it forks a rank: what every rank would import first.
PRELOAD = ["torch", "torch.distributed", "megatron_serve.engine.group.follower"]

_fork_here = False


def fork_ranks_here() -> None:
    """This process forks its group's ranks itself from now on (the ``engine`` command's, see the module's note).
    Where a thread or CUDA has started by the time the group starts, the ranks still come from the fork server: a
    fork copies no other thread, so a lock one held would stay held in the rank for good."""
    global _fork_here  # noqa: PLW0603 - a process's start method, as multiprocessing's own
    _fork_here = True


def forks_safely() -> bool:
    """Whether a fork of this process now copies no lock another thread holds: no thread runs but the main one and
    the lifeline's watch (a local fleet's engine has one from its first line; it holds none), and CUDA is not up."""
    others = [thread for thread in threading.enumerate() if thread is not threading.main_thread()]
    return all(thread.name == WATCH_THREAD for thread in others) and not torch.cuda.is_initialized()


def rank_context() -> multiprocessing.context.BaseContext:
    """How this process starts its ranks: forked from it (:func:`fork_ranks_here`), else from the fork server."""
    if _fork_here and forks_safely():
        return multiprocessing.get_context("fork")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # read when the server starts: once a process
    short_socket_directory()
    return context


def abandon_group(workers: list[multiprocessing.Process]) -> None:
    """Rank 0 failed after the group formed: leave it and stop this machine's other ranks.

    Without this a failed start left the process's default group behind, and every later engine
    in the process failed with "trying to initialize the default process group twice".
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    for worker in workers:
        worker.terminate()
        worker.join(timeout=30)


def reimported_main() -> bool:
    """Whether this process is a spawned one still importing its parent's ``__main__`` (multiprocessing's
    ``_inheriting``, what its own "bootstrapping phase" error checks): a script without a main guard."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))  # set by spawn's _main only


def refuse_reimported_main() -> None:
    """Exit at once, saying why, when a rank's process re-runs its parent's script: without this the script's
    engine started ranks of its own there, multiprocessing refused, and rank 0 waited for the missing rank until
    the rendezvous timed out (300 s), then said "could not join the group". ``os._exit``: the fork server turns any
    exception, ``SystemExit`` too, into exit code 1, and this process has run nothing yet that needs ending."""
    if reimported_main():
        print(f"megatron-serve: tensor-parallel rank process {os.getpid()} is running its parent's script again: "
              f"{GUARD_HINT}", file=sys.stderr, flush=True)
        os._exit(REIMPORTED_MAIN_EXIT)


def spawn_local_workers(model_dir: str, config: InferenceConfig, placement: Placement,
                        listener: socket.socket | None = None) -> list[multiprocessing.Process]:
    """Start this machine's ranks other than rank 0 as child processes; returns once each has started (reached
    :func:`run_worker`), and raises at once when one exits before it did. ``listener``: rank 0's rendezvous socket,
    which a forked rank closes (it is rank 0's to serve)."""
    context = rank_context()
    environment = dict(os.environ)
    inherited = (listener.fileno(),) if listener is not None and context.get_start_method() == "fork" else ()
    workers, started = [], []
    for index in range(placement.local_count):
        rank = placement.first_local_rank + index
        if index == 0 and (rank == 0 or config.data_parallel_size > 1):  # this process: a leader
            continue
        event = context.Event()
        process = context.Process(target=run_forked_worker,
                                  args=(environment, inherited, model_dir, config.to_dict(), placement, rank, index,
                                        event),
                                  name=f"megatron-tp-rank-{rank}", daemon=True)
        process.start()
        workers.append(process)
        started.append(event)
    try:
        wait_started(workers, started)
    except BaseException:
        for worker in workers:
            worker.terminate()
            worker.join(timeout=30)
        raise
    return workers


#: The longest path of a Unix socket (``sun_path``, less its terminating byte), and what multiprocessing adds to its
#: temporary directory's for the fork server's socket (``/pymp-XXXXXXXX/listener-XXXXXXXX``).
SOCKET_PATH_MAX = 107
FORKSERVER_SUFFIX = 36


def short_socket_directory() -> None:
    """Where ``TMPDIR`` is too long for the fork server's socket (a ``run`` fleet's engine gets a directory of its
    own, deep in a test's or a pod's), this process's multiprocessing directory goes under the system's short one
    instead (what Python 3.13's multiprocessing does itself): the server's bind failed with "AF_UNIX path too long"
    and the engine exited at start."""
    from multiprocessing import util  # noqa: PLC0415

    if len(tempfile.gettempdir()) + FORKSERVER_SUFFIX <= SOCKET_PATH_MAX:
        return
    saved = tempfile.tempdir
    tempfile.tempdir = next(d for d in ("/tmp", "/dev/shm", os.getcwd()) if os.access(d, os.W_OK))
    try:
        util.get_temp_dir()  # made now, under the short directory, and kept for this process (removed at its exit)
    finally:
        tempfile.tempdir = saved


def remove_fork_server_directory() -> None:
    """Remove this process's multiprocessing directory (``pymp-*``, where the fork server's socket is), as the
    interpreter's exit would: a process that ends with ``os._exit`` (the ``engine`` command, to skip torch's slow
    teardown) skips that, and every tensor- or pipeline-parallel engine stopped left one in the temporary directory."""
    directory = multiprocessing.current_process()._config.get("tempdir")  # set by multiprocessing.util.get_temp_dir
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


def run_forked_worker(environment: dict[str, str], inherited: tuple[int, ...], model_dir: str, config_dict: dict,
                      placement: Placement, rank: int, local_index: int, started: multiprocessing.synchronize.Event
                      ) -> None:
    """A forked rank: rank 0's environment of now (``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES``, ``MASTER_ADDR``...
    are read after this; the fork server's is the one it started with), without rank 0's ``inherited`` sockets, then
    :func:`.follower.run_worker`."""
    for descriptor in inherited:
        os.close(descriptor)
    os.environ.clear()
    os.environ.update(environment)
    run_worker(model_dir, config_dict, placement, rank, local_index, started)


def wait_started(workers: list[multiprocessing.Process], started: list[multiprocessing.synchronize.Event]) -> None:
    """Wait until every worker set its ``started`` event, up to the rendezvous timeout; a worker that exits first
    fails the start at once, with why when it says (:data:`REIMPORTED_MAIN_EXIT`)."""
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
    while not all(event.is_set() for event in started):
        for worker, event in zip(workers, started):
            if not event.is_set() and worker.exitcode is not None:
                why = GUARD_HINT if worker.exitcode == REIMPORTED_MAIN_EXIT else "its output above says why"
                raise RuntimeError(f"{worker.name}'s process exited (code {worker.exitcode}) before it started: {why}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks not started within {RENDEZVOUS_TIMEOUT_S:.0f}s")
        multiprocessing.connection.wait([w.sentinel for w in workers], timeout=0.05)



def start_rank_zero(model_dir: str, config: InferenceConfig
                    ) -> tuple[TensorParallel, PlanChannel, torch.device, list[multiprocessing.Process]]:
    """Start this machine's other ranks and join the group as rank 0 (when this machine holds it). A data-parallel
    rank started for a group that already formed (a lost rank's restart) meets no one here: it gets groups to load
    its model with, and joins the group at its first turn (:meth:`.survival.GroupSurvival.join`)."""
    refuse_reimported_main()
    dp = config.data_parallel_size > 1
    placement = data_parallel_placement(config) if dp else placement_for(config.world_size)
    check_local_devices(placement, torch.device(config.device).type)
    listener, placement = reserve_rendezvous(placement) if placement.master_port == 0 else (None, placement)
    try:
        workers = spawn_local_workers(model_dir, config, placement, listener)
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    if not placement.hosts_rank_zero and not dp:
        # This machine holds only followers: serve them until they exit; rank 0 lives in another pod.
        for worker in workers:
            worker.join()
        raise SystemExit(max((w.exitcode or 0) for w in workers) if workers else 0)
    device = rank_device(0, config)
    try:
        store = host_store(listener, placement) if listener is not None else None
        if store is None and dp and config.elastic_expert_group and (not placement.hosts_rank_zero
                                                                     or store_hosted_elsewhere()):
            store = client_store(placement)
            if running(store) is not None:  # started for a group that formed without it: it joins at its first turn
                tp, channel = joiner_groups(config, store)
                return tp, channel, device, workers
        tp, channel = join_group(placement, placement.first_local_rank, device, config, store)
    except BaseException:
        abandon_group(workers)
        raise
    return tp, channel, device, workers
