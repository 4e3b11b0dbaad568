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

from tests.helpers import free_port
from tests.helpers import wait_until

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


@pytest.mark.parametrize("layout", ["--tensor-parallel-size", "--pipeline-parallel-size"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_parallel_engine_stopped_leaves_no_fork_server_folder(tiny_llama, layout, signum):
    """A TP=2 or PP=2 engine starts its second rank from multiprocessing's fork server, whose socket lives in a
    ``pymp-*`` folder; the engine process ends with ``os._exit``, which left the folder behind at every stop."""
    with serving(tiny_llama, layout, "2") as (proc, log, tmpdir):
        wait_for(proc, log, READY)
        assert left(tmpdir, "pymp-*"), "no fork server folder while serving: the test tests nothing"
        os.killpg(proc.pid, signum)
        assert proc.wait(120) == (130 if signum == signal.SIGINT else 0), log.read_text()[-3000:]
        assert left(tmpdir, "pymp-*") == []


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
