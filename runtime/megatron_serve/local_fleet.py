"""A coordinator and N engine processes on this machine, started and stopped as one unit.

Used by ``MegatronLLM`` / ``MegatronAsyncLLM`` in coordinator mode when no coordinator address is
given, and by tests and benchmarks. Children are real ``megatron-serve`` processes (the same code
paths as a deployment); their logs go to files so that a full pipe can never block them, and a
child that dies during start-up is reported with the tail of its log. The fleet has a secret
(``token``; a fresh one when none is given) that every child gets in its environment, never on a
command line; ``insecure=True`` starts it without one (benchmarks only).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .config import InferenceConfig
from .fleet_argv import TOKEN_ENV, inference_config_to_argv
from .security import make_secret

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


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


class LocalFleet:
    """``start()`` returns the coordinator address; ``stop()`` ends every child (STOP first, then signals)."""

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
    ) -> None:
        """``inference_config``: the engines' settings, tensor parallelism included; ``tokenizer_dir``:
        tokenizer files for the coordinator and every engine (default: the model's). On GPUs each
        engine group gets GPUs of its own."""
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.model_dir = str(model_dir)
        self.num_engines = num_engines
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
        self.engine_args = [*inference_config_to_argv(inference_config), *tensor_parallel]
        device = inference_config.device if inference_config is not None else InferenceConfig().device
        self.gpus = gpu_slices(visible_gpus(), num_engines, ranks) if str(device).startswith("cuda") else None
        self.tokenizer_args = ["--tokenizer", str(tokenizer_dir)] if tokenizer_dir is not None else []
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="megatron-fleet-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.coordinator: subprocess.Popen | None = None
        self.engines: list[subprocess.Popen] = []
        self.address: str | None = None

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop(TOKEN_ENV, None)
        if self.token:
            env[TOKEN_ENV] = self.token  # not on the command line, where `ps` would show it
        return env

    def _spawn(self, args: list[str], log_name: str, gpus: str | None = None) -> subprocess.Popen:
        env = self._env()
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        log = open(self.log_dir / log_name, "ab")
        try:
            return subprocess.Popen([self.python, "-m", "megatron_serve.cli", *args], stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        finally:
            log.close()

    def start(self, timeout: float = 120.0) -> str:
        """Start the coordinator, wait until it listens, start the engines; returns the address."""
        address_file = self.log_dir / "coordinator.address"
        address_file.unlink(missing_ok=True)
        self.coordinator = self._spawn(
            ["coordinator", "--model", self.model_dir, "--host", self.host, "--port", str(self.port),
             "--routing", self.routing, "--heartbeat-timeout", str(self.heartbeat_timeout),
             "--address-file", str(address_file), *self.tokenizer_args,
             *([] if self.token else ["--insecure"])], "coordinator.log")
        deadline = time.monotonic() + timeout
        while not address_file.exists():
            if self.coordinator.poll() is not None:
                raise RuntimeError(f"the coordinator exited with code {self.coordinator.returncode}:\n"
                                   f"{_tail(self.log_dir / 'coordinator.log')}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the coordinator did not start within {timeout:.0f}s (log: {self.log_dir})")
            time.sleep(0.05)
        self.address = address_file.read_text().strip()
        for index in range(self.num_engines):
            self.add_engine(group=index)
        logger.info("local fleet: coordinator at %s, %d engine(s) starting (logs in %s)", self.address,
                    self.num_engines, self.log_dir)
        return self.address

    def add_engine(self, group: int | None = None, extra: list[str] | None = None) -> subprocess.Popen:
        """Start one more engine process (used by ``start()``, and by tests that replace engines);
        ``extra``: its flags instead of the fleet's ``engine_args``."""
        if self.address is None:
            raise RuntimeError("start() the fleet first")
        args = ["engine", "--model", self.model_dir, "--coordinator", self.address,
                "--drain-timeout", str(self.drain_timeout), *self.tokenizer_args,
                *(self.engine_args if extra is None else extra)]
        if group is not None:
            args += ["--group", str(group)]
        slot = len(self.engines) if group is None else group  # a replacement engine takes its group's GPUs
        gpus = self.gpus[slot % len(self.gpus)] if self.gpus else None
        proc = self._spawn(args, f"engine-{len(self.engines)}.log", gpus)
        self.engines.append(proc)
        return proc

    def check_alive(self) -> None:
        """Raise with the child's log tail if the coordinator or an engine died unexpectedly."""
        if self.coordinator is not None and self.coordinator.poll() is not None:
            raise RuntimeError(f"the coordinator exited with code {self.coordinator.returncode}:\n"
                               f"{_tail(self.log_dir / 'coordinator.log')}")
        for index, proc in enumerate(self.engines):
            if proc.poll() is not None and proc.returncode != 0:
                raise RuntimeError(f"engine {index} exited with code {proc.returncode}:\n"
                                   f"{_tail(self.log_dir / f'engine-{index}.log')}")

    def stop(self, timeout: float = 30.0, stop_acknowledged: bool = False) -> None:
        """End every child: SIGTERM (engines drain, hand back and exit 0), SIGKILL after ``timeout``.

        ``stop_acknowledged``: the fleet already acknowledged STOP, so the engines are exiting on
        their own; give them until the deadline before signalling.
        """
        deadline = time.monotonic() + timeout
        for proc in self.engines:
            self._end(proc, deadline, wait_first=stop_acknowledged)
        if self.coordinator is not None:
            self._end(self.coordinator, time.monotonic() + 10.0, wait_first=False)

    @staticmethod
    def _end(proc: subprocess.Popen, deadline: float, wait_first: bool) -> None:
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
        for proc in [*self.engines, self.coordinator]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
