"""``megatron-serve serve`` stopped as a user and a host stop it, with real processes and signals: what it prints,
its exit code, and what it leaves in the temporary directory.

Each run gets a short TMPDIR of its own (multiprocessing puts its fork server's folder under a long one's
replacement, /tmp, where the test would not see it) and its own XDG_RUNTIME_DIR.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers import free_port, rank_processes, wait_until
from tests.run_stack import child_pids, role_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

READY = "megatron-serve is ready"


@contextmanager
def serving(model: str, *extra: str) -> Iterator[tuple[subprocess.Popen, Path, Path]]:
    """``serve MODEL EXTRA`` in a session of its own (a terminal's Ctrl-C reaches only it, as here): (process, its
    output, its TMPDIR); whatever is left of it is killed at the end."""
    with tempfile.TemporaryDirectory(prefix="sig-") as tmp:
        tmpdir = Path(tmp)
        log = tmpdir.with_suffix(".log")
        env = {**os.environ, "TMPDIR": tmp, "XDG_RUNTIME_DIR": tmp}
        env.pop("MEGATRON_SERVE_COORDINATOR", None)
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "megatron_serve.cli", "serve", model, "--port",
                                     str(free_port()), "--coordinator-port", "0", "--num-kv-blocks", "64", *extra],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        try:
            yield proc, log, tmpdir
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.unlink(missing_ok=True)


def wait_for(proc: subprocess.Popen, log: Path, text: str, timeout: float = 180) -> None:
    def printed() -> bool:
        assert proc.poll() is None, f"serve exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        return text in log.read_text()

    wait_until(printed, timeout, f"serve to print {text!r}", interval=0.01)


def left(tmpdir: Path, pattern: str) -> list[str]:
    return sorted(str(p.relative_to(tmpdir)) for p in tmpdir.glob(pattern))


def test_sigint_the_instant_ready_prints_stops_every_api_server_quietly_with_130(tiny_llama):
    """"ready" with ``--api-server-count 2`` means both processes serve: Ctrl-C at once drains both (before, the
    second was still importing and printed a KeyboardInterrupt traceback) and the run exits 130, the shell's code for
    an interrupt, as it does while the model loads (it exited 0 once ready)."""
    with serving(tiny_llama, "--api-server-count", "2") as (proc, log, tmpdir):
        wait_for(proc, log, READY)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(120) == 130, log.read_text()[-3000:]
        output = log.read_text()
        assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
        assert "SIGTERM: draining" in output, output  # the second API server was serving: it drained
        assert output.splitlines()[-1].strip() == "stopped", output


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_a_signal_while_the_model_loads_exits_as_it_does_once_ready(tiny_llama, signum, code):
    """One convention at every stage: 130 for SIGINT, 0 for SIGTERM (a stop asked of a service, done), as
    test_stack_ports' SIGTERM after ready exits 0 (SIGTERM during the load exited 130)."""
    with serving(tiny_llama) as (proc, log, _):
        wait_for(proc, log, "[3/4] starting")
        os.killpg(proc.pid, signum)
        assert proc.wait(120) == code, log.read_text()[-3000:]
        output = log.read_text()
        assert READY not in output and "Traceback" not in output, output


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.parametrize("layout, signum", [("--tensor-parallel-size", signal.SIGINT),
                                            ("--pipeline-parallel-size", signal.SIGTERM)])
def test_a_parallel_engine_forks_its_ranks_and_stopped_leaves_no_fork_server_folder(tiny_llama, layout, signum):
    """A TP=2 or PP=2 engine forks its second rank itself (engine/group/spawn.py), no multiprocessing fork server
    beside it, so a stop by either signal leaves no ``pymp-*`` folder (the fork server's, which an engine ending
    with ``os._exit`` left behind at every stop). Each layout once and each signal once: the signals' exit codes at
    every stage are the tests above's."""
    with serving(tiny_llama, layout, "2") as (proc, log, tmpdir):
        wait_for(proc, log, READY)
        engines = [pid for pid in child_pids(proc.pid) if role_of(pid) == "engine"]
        ranks = [rank for engine in engines for rank in rank_processes(engine)]
        assert len(engines) == 1 and len(ranks) == 1, (engines, ranks)
        assert parent_of(ranks[0]) == engines[0], "the rank is not the engine's own child: a fork server started it"
        assert left(tmpdir, "pymp-*") == []
        os.killpg(proc.pid, signum)
        assert proc.wait(120) == (130 if signum == signal.SIGINT else 0), log.read_text()[-3000:]
        assert left(tmpdir, "pymp-*") == []


def made_and_removed(tmpdir: Path, remove: bool) -> int:
    """In a child forked from this process (spawn.py and torch imported here: the child imports nothing): make its
    multiprocessing folder under ``tmpdir`` as a fork server's start does, remove it or not, and end by ``os._exit``
    as the engine command does; the child's exit code."""
    from multiprocessing import current_process, util  # noqa: PLC0415

    from megatron_serve.engine.group.spawn import remove_fork_server_directory  # noqa: PLC0415

    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            tempfile.tempdir = str(tmpdir)
            current_process()._config.pop("tempdir", None)  # the parent's folder, if it has one, is not the child's
            util.get_temp_dir()
            if remove:
                remove_fork_server_directory()
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_an_engine_that_used_the_fork_server_removes_its_folder_before_os_exit(tmp_path):
    """Where the engine's ranks still come from the fork server (another thread running, CUDA up: spawn.py's
    ``forks_safely``), its ``pymp-*`` folder goes with ``remove_fork_server_directory`` before the engine's
    ``os._exit``; without it (the control) the folder stays."""
    kept, removed = tmp_path / "kept", tmp_path / "removed"
    kept.mkdir()
    removed.mkdir()
    assert made_and_removed(kept, remove=False) == 0
    assert made_and_removed(removed, remove=True) == 0
    assert left(kept, "pymp-*"), "the control left no folder: the test tests nothing"
    assert left(removed, "pymp-*") == []


def test_kill_9_of_a_run_with_two_api_servers_leaves_no_private_folder(tiny_llama):
    """docs/faults.md: after ``kill -9`` of ``run`` its janitor removes what it made; the API servers' spec folder
    and Prometheus' multiprocess folder (made once the model loaded) were left."""
    with serving(tiny_llama, "--api-server-count", "2") as (proc, log, tmpdir):
        wait_for(proc, log, READY)
        made = left(tmpdir, "megatron-serve-*-*")
        assert len(made) == 2, made  # megatron-serve-api-*, megatron-serve-metrics-*
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while left(tmpdir, "megatron-serve-*-*") or left(tmpdir, "megatron-fleet-*"):
            assert time.monotonic() < deadline, f"15 s after kill -9 of run: {left(tmpdir, '*')}"
            time.sleep(0.05)


def test_a_directory_given_to_a_janitor_that_was_killed_is_no_error(tmp_path):
    """``run`` tells its janitor of the API servers' folders once the model loaded; a janitor killed before then
    (``kill -9`` of it) must not end ``run`` with a broken pipe."""
    from megatron_serve.commands.run_janitor import Janitor  # noqa: PLC0415

    janitor = Janitor([])
    janitor.process.kill()
    janitor.process.wait()
    janitor.add(tmp_path)  # nothing to tell: the folder is left to run's own stop
    assert tmp_path.exists()
