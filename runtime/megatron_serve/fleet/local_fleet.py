"""A coordinator and N engine processes on this machine, started and stopped as one unit.

With ``data_parallel_size`` > 1 (data-parallel attention, ``enable_expert_parallel``) each engine group is a gang
of that many engine processes, one per attention rank (``engine --data-parallel-size N --data-parallel-rank d
--group g``), meeting at a rendezvous port of their own; a rank that dies restarts its whole gang on a fresh port
(:class:`~megatron_serve.fleet.supervisor.Gang`), and the coordinator resubmits the gang's requests.

Used by ``megatron-serve run``, by ``MegatronLLM`` / ``MegatronAsyncLLM`` in coordinator mode when no
coordinator address is given, and by tests and benchmarks. Children are real ``megatron-serve``
processes (the same code paths as a deployment); their logs go to files so that a full pipe can
never block them, and a child that dies during start-up is reported with the tail of its log. The
fleet has a secret (``token``; a fresh one when none is given) that every child gets in its
environment, never on a command line; ``insecure=True`` starts it without one (benchmarks only).

Its engine and rendezvous-store processes are forked from a launcher process that imported torch once
(``engine_start="fork"``, the default on Linux: :mod:`megatron_serve.commands.launcher`), or each started as a fresh
interpreter (``"exec"``); the coordinator is always a fresh one.

No child outlives the fleet's process, whatever ends it (:mod:`megatron_serve.processes.lifeline`); once
:meth:`LocalFleet.supervise` is called, a child that dies is restarted with back-off
(:mod:`megatron_serve.fleet.supervisor`). The fleet's own directory (its logs, when no ``log_dir`` is
given: ``$TMPDIR/megatron-fleet-*``) is removed when the fleet stops; one whose process was killed
before it could is removed by the next fleet of the same user that starts (a lock held for the
fleet's life tells a live directory from a stale one). 17 of them were found on one machine. A fleet
still up when its interpreter exits (a script with ``LLM(..., enable_sleep_mode=True)`` that never calls
``shutdown()``) is killed and its directory removed by an ``atexit`` hook, not left for the next fleet.
"""

from __future__ import annotations

import atexit
import dataclasses
import fcntl
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..config import InferenceConfig
from .argv import disaggregated_roles, inference_config_to_argv, kv_role_argv
from .coordinator_watch import COORDINATOR_LIVENESS_TIMEOUT, CoordinatorWatch
from .launcher_client import DEFAULT_ENGINE_START, ENGINE_STARTS, ChildProcess, Launcher
from ..processes.lifeline import Lifeline
from ..wire.security import TOKEN_ENV, make_secret
from .supervisor import Child, Gang, Supervisor, exit_cause, log_tail

logger = logging.getLogger("megatron_serve.local_fleet")


def visible_gpus() -> list[str]:
    """This machine's GPUs as ``CUDA_VISIBLE_DEVICES`` names them (all of them when it is unset)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [name.strip() for name in listed.split(",") if name.strip()]
    import torch  # noqa: PLC0415 - only for a fleet on GPUs

    return [str(index) for index in range(torch.cuda.device_count())]


def gpu_slices(visible: list[str], num_engines: int, ranks: int) -> list[str]:
    """Each engine group's ``CUDA_VISIBLE_DEVICES``: ``ranks`` GPUs of its own, in order.

    Without it every engine process took GPU 0 (and its tensor-parallel ranks GPUs 0..ranks-1), so
    ``run --engines 2`` served two engines from one GPU while the others idled.
    """
    needed = num_engines * ranks
    if needed > len(visible):
        raise ValueError(
            f"{num_engines} engine(s) of {ranks} GPU(s) each need {needed} GPUs, but {len(visible)} "
            f"{'is' if len(visible) == 1 else 'are'} visible ({','.join(visible) or 'none'}): lower --engines or "
            f"--tensor-parallel, or serve on --device cpu")
    return [",".join(visible[index * ranks:(index + 1) * ranks]) for index in range(num_engines)]


def check_data_parallel(size: int, config: InferenceConfig | None, disaggregated: int) -> None:
    """A fleet's ``data_parallel_size`` (attention ranks per group), refused naming what it lacks."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"data_parallel_size must be a positive integer, got {size!r}")
    if size == 1:
        return
    if config is None or not config.enable_expert_parallel:
        raise ValueError(f"data_parallel_size {size} in a group is data-parallel attention, which shares the MoE "
                         "layers' experts: it needs enable_expert_parallel (replicas are engine groups: num_engines)")
    if disaggregated:
        raise ValueError("prefill/decode disaggregation is not implemented with data-parallel attention")
    if config.data_parallel_size != 1:
        raise ValueError(f"inference_config.data_parallel_size is {config.data_parallel_size}: a fleet gives each "
                         "engine its rank; pass the size as data_parallel_size")
    dataclasses.replace(config, data_parallel_size=size)  # what data-parallel attention does not serve, named


def free_port(host: str) -> int:
    """A port free on ``host`` now (a gang's rendezvous: torch.distributed's store binds it again)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


RUN_DIR_PREFIX = "megatron-fleet-"
_LOCK = ".lock"


def _tail(path: Path) -> str:
    """A dead child's log tail for an error message."""
    tail = log_tail(path, 15)
    return "(no log)" if tail is None else tail


def make_run_dir() -> tuple[Path, int]:
    """A new private directory for one fleet, and the descriptor of the lock held on it for the fleet's life.

    Stale directories of this user (their lock free: the fleet that made them is gone) are removed first.
    """
    remove_stale_run_dirs()
    path = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))  # mode 0700
    fd = os.open(path / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return path, fd


def fleet_directory(log_dir: str | os.PathLike | None) -> tuple[Path, int | None]:
    """Where a fleet's logs go, and the lock it holds on its own directory (made by :func:`make_run_dir`) when no
    ``log_dir`` is given (None: a given directory, made if need be, and kept)."""
    if log_dir is None:
        return make_run_dir()
    path = Path(log_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path, None


def remove_stale_run_dirs(root: str | os.PathLike | None = None) -> list[Path]:
    """Remove this user's fleet directories under ``root`` (default: the temporary directory) whose fleet is
    gone; returns them. A directory without a lock file (being created, or not a fleet's) is left alone."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(RUN_DIR_PREFIX + "*"):
        try:
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
            fd = os.open(path / _LOCK, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: its fleet lives
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.info("removed %d directory(ies) of local fleets that were killed: %s", len(removed),
                    ", ".join(map(str, removed)))
    return removed


class LocalFleet:
    """``start()`` returns the coordinator address; ``stop()`` ends every child (STOP first, then signals)."""

    #: Once supervised, a coordinator that answers nothing this long is killed and started again
    #: (:mod:`.coordinator_watch`; None: only a dead one is).
    liveness_timeout: float | None = COORDINATOR_LIVENESS_TIMEOUT
    _watch: CoordinatorWatch | None = None  # that check's connection, made by supervise()

    def __init__(
        self,
        model_dir: str | os.PathLike,
        num_engines: int = 1,
        inference_config: InferenceConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        routing: str = "least_loaded",
        heartbeat_timeout: float = 10.0,
        drain_timeout: float = 30.0,
        log_dir: str | os.PathLike | None = None,
        python: str = sys.executable,
        tokenizer_dir: str | os.PathLike | None = None,
        insecure: bool = False,
        max_request_logprobs: int | None = None,
        session_ttl: float | None = None,
        prefill_engines: int = 0,
        decode_engines: int = 0,
        data_parallel_size: int = 1,
        engine_start: str = DEFAULT_ENGINE_START,
    ) -> None:
        """``inference_config``: the engines' settings, tensor parallelism included; ``tokenizer_dir``:
        tokenizer files for the coordinator and every engine (default: the model's). On GPUs each
        engine group gets GPUs of its own. ``log_dir``: where the logs go and stay (default: the
        fleet's own directory, removed when it stops). ``max_request_logprobs``: the coordinator's
        ``--max-request-logprobs`` (default: its own), so that one figure governs the fleet and the
        HTTP server in front of it. ``prefill_engines`` and ``decode_engines``: a disaggregated fleet of that many
        of each instead of ``num_engines`` colocated ones (coordinator.disaggregation). ``data_parallel_size``:
        each of the ``num_engines`` groups is that many data-parallel attention ranks sharing the experts
        (``inference_config.enable_expert_parallel``), an engine process each; ``num_engines`` is then the
        fleet's engine processes, ``groups`` its groups. ``session_ttl``: the coordinator's ``--session-affinity-ttl``
        (default: its own). ``engine_start``: ``fork`` (engines and rendezvous stores forked from the fleet's launcher)
        or ``exec`` (each a fresh interpreter; so is every child of a fleet of another ``python`` than this one's)."""
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        if engine_start not in ENGINE_STARTS:
            raise ValueError(f"engine_start must be one of {', '.join(ENGINE_STARTS)}, got {engine_start!r}")
        check_data_parallel(data_parallel_size, inference_config, prefill_engines or decode_engines)
        self.kv_roles = disaggregated_roles(num_engines, prefill_engines, decode_engines)
        self.groups = len(self.kv_roles)
        self.data_parallel_size = data_parallel_size
        self.model_dir = str(model_dir)
        self.num_engines = self.groups * data_parallel_size  # engine processes: each registers
        self.inference_config = inference_config
        self.host = host
        self.port = port
        if insecure and token:
            raise ValueError("an insecure fleet has no secret: pass token or insecure, not both")
        self.token = None if insecure else token or make_secret()
        self.routing = routing
        self.heartbeat_timeout = heartbeat_timeout
        self.drain_timeout = drain_timeout
        self.python = python
        ranks = inference_config.tensor_parallel_size if inference_config is not None else 1
        tensor_parallel = ["--tensor-parallel", str(ranks)] if ranks > 1 else []
        data_parallel = ["--data-parallel-size", str(data_parallel_size)] if data_parallel_size > 1 else []
        self.engine_args = [*inference_config_to_argv(inference_config), *tensor_parallel, *data_parallel]
        device = inference_config.device if inference_config is not None else InferenceConfig().device
        # Each engine process's ranks (pipeline stages included; one attention rank's), and its GPUs
        self.ranks_per_engine = inference_config.world_size if inference_config is not None else 1
        self.gpus = (gpu_slices(visible_gpus(), self.num_engines, self.ranks_per_engine)
                     if str(device).startswith("cuda") else None)
        self.rendezvous_host = "127.0.0.1"  # every rank of a gang runs here
        self.tokenizer_args = ["--tokenizer", str(tokenizer_dir)] if tokenizer_dir is not None else []
        self.budget_args = ["--max-request-logprobs", str(max_request_logprobs)] if max_request_logprobs else []
        if session_ttl is not None:
            self.budget_args += ["--session-affinity-ttl", str(session_ttl)]
        self.log_dir, self._lock_fd = fleet_directory(log_dir)
        self._coordinator: Child | None = None
        self._engines: list[Child] = []
        self._gangs: dict[int, Gang] = {}  # engine group -> its gang (data_parallel_size > 1)
        self._stores: list[Child] = []  # the elastic gangs' rendezvous stores, each a process of its own
        self.address: str | None = None
        self._lifeline = Lifeline()
        self._supervisor = Supervisor(self._lifeline, launcher=self._launcher(engine_start))
        self._ended = False
        atexit.register(self.kill)  # unregistered once the fleet ended (_release)

    def _launcher(self, engine_start: str) -> Launcher | None:
        """What forks its engines and rendezvous stores: a launcher of this interpreter, for ``fork`` where the fleet
        runs this one (its ``python``), else None (each is exec'd)."""
        if engine_start != "fork" or self.python != sys.executable:
            return None
        return Launcher(self._lifeline, self.log_dir / "launcher.log")

    @property
    def coordinator(self) -> ChildProcess | None:
        """The coordinator's current process."""
        return self._coordinator.proc if self._coordinator is not None else None

    @property
    def engines(self) -> list[ChildProcess]:
        """Each engine's current process, in the order they were added."""
        return [child.proc for child in self._engines if child.proc is not None]

    @property
    def restarts(self) -> dict[str, list[str]]:
        """Why each child was restarted so far (child name -> causes), for tests and status lines."""
        return {child.name: list(child.causes) for child in [self._coordinator, *self._engines]
                if child is not None and child.causes}

    def _env(self, gpus: str | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.pop(TOKEN_ENV, None)
        if self.token:
            env[TOKEN_ENV] = self.token  # not on the command line, where `ps` would show it
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        return env

    def _command(self, args: list[str]) -> list[str]:
        return [self.python, "-m", "megatron_serve.cli", *args]

    def start(self, timeout: float = 120.0) -> str:
        """Start the coordinator, wait until it listens, start the engines; returns the address."""
        address_file = self.log_dir / "coordinator.address"
        address_file.unlink(missing_ok=True)
        self._coordinator = Child("coordinator", self._coordinator_argv(self.port, address_file),
                                  self.log_dir / "coordinator.log", self._env())
        self._supervisor.start_child(self._coordinator)
        self._supervisor.start_launcher(self._env())  # its torch import runs while the coordinator starts
        deadline = time.monotonic() + timeout
        while not address_file.exists():
            self.check_alive()
            if time.monotonic() > deadline:
                tail = _tail(self._coordinator.log)
                self.stop()  # (its directory goes too: the log's tail is in the error)
                raise TimeoutError(f"the coordinator did not start within {timeout:.0f}s; its log ends:\n{tail}")
            time.sleep(0.05)
        self.address = address_file.read_text().strip()
        # A restarted coordinator binds the port this one got (the engines and clients reconnect to it).
        self._coordinator.argv = self._coordinator_argv(int(self.address.rsplit(":", 1)[1]), address_file)
        for index, role in enumerate(self.kv_roles):
            if self.data_parallel_size > 1:
                self.add_gang(index)
            else:
                self.add_engine(group=index,
                                extra=None if role == "kv_both" else [*self.engine_args, *kv_role_argv(role)])
        logger.info("local fleet: coordinator at %s, %d engine(s) starting (logs in %s)", self.address,
                    self.num_engines, self.log_dir)
        return self.address

    def _coordinator_argv(self, port: int, address_file: Path) -> list[str]:
        return self._command(["coordinator", "--model", self.model_dir, "--host", self.host, "--port", str(port),
                              "--routing", self.routing, "--heartbeat-timeout", str(self.heartbeat_timeout),
                              "--address-file", str(address_file), *self.tokenizer_args, *self.budget_args,
                              *([] if self.token else ["--insecure"])])

    def add_engine(self, group: int | None = None, extra: list[str] | None = None) -> ChildProcess:
        """Start one more engine process (used by ``start()``, and by tests that replace engines);
        ``extra``: its flags instead of the fleet's ``engine_args``."""
        if self.address is None:
            raise RuntimeError("start() the fleet first")
        args = ["engine", "--model", self.model_dir, "--coordinator", self.address,
                "--drain-timeout", str(self.drain_timeout), *self.tokenizer_args,
                *(self.engine_args if extra is None else extra)]
        if group is not None:
            args += ["--group", str(group)]
        slot = len(self._engines) if group is None else group  # a replacement engine takes its group's GPUs
        gpus = self.gpus[slot % len(self.gpus)] if self.gpus else None
        index = len(self._engines)
        name = f"engine {index}" + (f" (group {group})" if group is not None else "")
        child = Child(name, self._command(args), self.log_dir / f"engine-{index}.log", self._env(gpus), fork=True)
        self._engines.append(child)
        return self._supervisor.start_child(child)

    def add_gang(self, group: int) -> list[ChildProcess]:
        """Start the ``data_parallel_size`` engine processes of group ``group``, one per attention rank, at a
        rendezvous port of their own (a fresh one at each restart of the gang). An elastic expert group's ranks meet
        in a ``rendezvous-store`` process of their own (bound where rank 0's store would be, given no secret), so
        that any rank's loss, rank 0's included, leaves the others serving and its restart joins them."""
        if self.address is None:
            raise RuntimeError("start() the fleet first")
        size = self.data_parallel_size
        members = []
        for rank in range(size):
            slot = group * size + rank
            gpus = self.gpus[slot % len(self.gpus)] if self.gpus else None
            args = ["engine", "--model", self.model_dir, "--coordinator", self.address,
                    "--drain-timeout", str(self.drain_timeout), *self.tokenizer_args, *self.engine_args,
                    "--data-parallel-rank", str(rank), "--group", str(group)]
            members.append(Child(f"engine {len(self._engines)} (group {group}, data-parallel rank {rank})",
                                 self._command(args), self.log_dir / f"engine-{len(self._engines)}.log",
                                 self._env(gpus), fork=True))
            self._engines.append(members[-1])

        config = dataclasses.replace(self.inference_config or InferenceConfig(), data_parallel_size=size)
        store = None
        if config.elastic_expert_group:
            env = dict(os.environ)
            env.pop(TOKEN_ENV, None)
            log = self.log_dir / f"rendezvous-store-{group}.log"
            store = Child(f"rendezvous store (group {group})", [], log, env, fork=True)
            self._stores.append(store)
            for child in members:  # rank 0 connects to it as the others do
                child.env["TORCHELASTIC_USE_AGENT_STORE"] = "True"

        def renew() -> None:
            port = str(free_port(self.rendezvous_host))
            for child in members:
                child.env.update(MASTER_ADDR=self.rendezvous_host, MASTER_PORT=port,
                                 WORLD_SIZE=str(self.ranks_per_engine * size), NPROC_PER_NODE=str(self.ranks_per_engine))
            if store is not None:
                store.argv = self._command(["rendezvous-store", "--host", self.rendezvous_host, "--port", port])

        self._gangs[group] = Gang(f"group {group}", members, renew, config.elastic_expert_group, store)
        return self._supervisor.start_gang(self._gangs[group])

    @property
    def elastic(self) -> bool:
        """Whether its groups are elastic expert groups, whose size the coordinator's STATUS says
        (:meth:`want_ranks`)."""
        return any(gang.elastic for gang in self._gangs.values())

    def want_ranks(self, expert_groups: list[dict[str, Any]], read_at: float) -> None:
        """The sizes wanted of the expert groups (STATUS's ``expert_groups``, asked for at ``read_at``, monotonic):
        each elastic gang starts again the ranks below its size that ``scale-ep`` took out before then (they
        join); the ranks above it stay out. Only a size a SCALE_EP asked for counts (``scaled``): a restarted
        coordinator's, its ``--data-parallel-size``, would undo a shrink it never saw."""
        for group in expert_groups:
            gang = self._gangs.get(group["group"])
            if gang is not None and gang.elastic and group["scaled"] and len(group["ranks"]) < group["wanted"]:
                self._supervisor.want_ranks(gang, group["wanted"], read_at)

    def supervise(self, on: bool = True) -> None:
        """From now on, restart a child that dies (signal or non-zero exit) with back-off, logging the cause, and a
        coordinator that answers nothing for ``liveness_timeout`` (``on=False``: no more restarts, e.g. before a STOP
        that ends the engines)."""
        if on and self._watch is None and self.liveness_timeout and self._coordinator is not None and self.address:
            self._watch = CoordinatorWatch(self.address, self.token, self.liveness_timeout)
            self._coordinator.hung = self._watch.hung
        self._supervisor.restart_dead(on)

    def check_alive(self) -> None:
        """Raise with the child's log tail if the coordinator or an engine died unexpectedly."""
        coordinator = self.coordinator
        if coordinator is not None and coordinator.poll() is not None:
            raise RuntimeError(f"the coordinator exited with {exit_cause(coordinator.returncode)}:\n"
                               f"{_tail(self.log_dir / 'coordinator.log')}")
        for index, child in enumerate(self._engines):
            proc = child.proc
            if proc is not None and proc.poll() is not None and proc.returncode != 0:
                raise RuntimeError(f"engine {index} exited with {exit_cause(proc.returncode)}:\n"
                                   f"{_tail(child.log)}")

    def stop(self, timeout: float = 30.0, stop_acknowledged: bool = False) -> None:
        """End every child: SIGTERM (engines drain, hand back and exit 0), SIGKILL after ``timeout``.

        ``stop_acknowledged``: the fleet already acknowledged STOP, so the engines are exiting on
        their own; give them until the deadline before signalling. The fleet's own directory goes too.
        """
        self._supervisor.restart_dead(False)
        deadline = time.monotonic() + timeout
        for proc in self.engines:
            self._end(proc, deadline, wait_first=stop_acknowledged)
        for proc in [store.proc for store in self._stores if store.proc is not None]:  # once no rank needs them
            self._end(proc, deadline, wait_first=False)
        if self.coordinator is not None:
            self._end(self.coordinator, time.monotonic() + 10.0, wait_first=False)
        self._release()

    @staticmethod
    def _end(proc: ChildProcess, deadline: float, wait_first: bool) -> None:
        if proc.poll() is not None:
            return
        if wait_first:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                return
            except subprocess.TimeoutExpired:
                pass
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=max(0.5, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL every child at once (test teardown, or after a failed start)."""
        self._supervisor.restart_dead(False)
        for proc in [*self.engines, *(store.proc for store in self._stores), self.coordinator]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        self._release()

    def _release(self) -> None:
        """After the children ended: the supervisor's thread, the lifeline and the fleet's own directory."""
        if self._ended:
            return
        self._ended = True
        atexit.unregister(self.kill)
        self._supervisor.close()
        if self._watch is not None:
            self._watch.close()
        self._lifeline.close()
        if self._lock_fd is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            os.close(self._lock_fd)
            self._lock_fd = None
