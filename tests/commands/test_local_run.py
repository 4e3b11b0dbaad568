"""``make run`` as a first-time user meets it, and ``control`` finding that run on its own.

The process test runs the real entry point (``make run ARGS=...``, the Makefile's own recipe, in
this interpreter's environment) while port 5555 is taken, then talks to it with ``control`` without
``--coordinator`` (the run's published address, in a private ``XDG_RUNTIME_DIR``) and with the official
``openai`` client, which asks the quick start's real model (SmolLM2-135M-Instruct) a question it knows.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from megatron_serve.commands import local_runs
from megatron_serve.commands.control import next_step
from megatron_serve.wire.protocol import DEFAULT_PORT
from tests.realmodel.shared import gguf_cache_home
from tests.helpers import wait_until
from tests.server.test_openai_e2e import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_each_state_says_what_it_means_and_which_verb_comes_next():
    assert "next: `megatron-serve control unpause`" in next_step("PAUSED")  # e.g. after resume
    suspended = next_step("SUSPENDED", " --coordinator tcp://h:1")
    assert "`megatron-serve control resume --coordinator tcp://h:1`, then `megatron-serve control unpause" in suspended
    assert "unpause" in next_step("STOPPED") and "joined again" in next_step("STOPPED")
    assert next_step("RUNNING").startswith("RUNNING: serving requests") and "next:" not in next_step("RUNNING")


def test_runs_are_private_found_by_directory_and_stale_ones_dropped(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    here, elsewhere = tmp_path / "project", tmp_path / "other"
    here.mkdir(), elsewhere.mkdir()
    monkeypatch.chdir(here)
    with pytest.raises(LookupError, match="no `megatron-serve run` is running"):
        local_runs.find_local_run()
    mine = local_runs.publish(os.getpid(), "tcp://127.0.0.1:5556", "http://x/v1", "m", "s" * 43)
    assert mine.directory.parent == tmp_path / "megatron-serve"
    for path in (mine.directory.parent, mine.directory):
        assert path.stat().st_mode & 0o777 == 0o700
    for name in ("run.json", "secret"):
        assert (mine.directory / name).stat().st_mode & 0o777 == 0o600
    assert local_runs.find_local_run() == mine and mine.secret() == "s" * 43
    assert local_runs.secret_for("tcp://127.0.0.1:5556") == "s" * 43 and local_runs.secret_for("tcp://h:1") is None
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = local_runs.publish(int(dead.stdout), "tcp://127.0.0.1:1", "", "gone", None)
    assert local_runs.find_local_run() == mine and not stale.directory.exists()
    monkeypatch.chdir(elsewhere)  # a run started in another directory is not taken for this one's
    with pytest.raises(LookupError, match=f"no `megatron-serve run` of yours was started in {elsewhere}.*"
                                          "tcp://127.0.0.1:5556.*pass --coordinator"):
        local_runs.find_local_run()
    monkeypatch.chdir(here)
    local_runs.publish(os.getppid(), "tcp://127.0.0.1:5557", "", "other", None)
    with pytest.raises(LookupError, match="2 `megatron-serve run` processes started in .*pass --coordinator"):
        local_runs.find_local_run()
    local_runs.withdraw(mine)
    assert [r.model for r in local_runs.live_runs()] == ["other"]
    assert local_runs.live_runs()[0].secret() is None  # an --insecure run has none


def test_the_next_run_removes_the_directory_of_a_run_killed_with_its_janitor(tmp_path, monkeypatch):
    """A run and its janitor both killed (kill -9 of the session) leave the run's directory, secret included:
    the next run of this user removes it as it publishes its own (before, only ``control`` did)."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = local_runs.publish(int(dead.stdout), "tcp://127.0.0.1:1", "", "gone", "s" * 43)
    assert (stale.directory / "secret").exists()
    mine = local_runs.publish(os.getpid(), "tcp://127.0.0.1:5556", "", "m", None)
    assert not stale.directory.exists() and mine.directory.exists()
    local_runs.withdraw(mine)


def test_runs_of_others_are_never_read(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    run = local_runs.publish(os.getpid(), "tcp://127.0.0.1:5556", "", "m", "s" * 43)
    (run.directory / "secret").chmod(0o644)  # readable by others: not a secret any more, and not this user's doing
    assert run.secret() is None
    run.directory.chmod(0o755)
    assert local_runs.live_runs() == []
    run.directory.parent.chmod(0o755)
    with pytest.raises(local_runs.UnsafeRunsDirectory, match="open to other users.*chmod 700"):
        local_runs.live_runs()
    with pytest.raises(local_runs.UnsafeRunsDirectory, match="open to other users"):
        local_runs.publish(os.getpid(), "tcp://127.0.0.1:5556", "", "m", None)
    run.directory.parent.chmod(0o700)
    planted = tmp_path / "planted"  # a directory another user could have made: not followed
    planted.mkdir(mode=0o700)
    (planted / "run.json").write_text(json.dumps({"pid": os.getpid(), "coordinator": "tcp://evil:1", "endpoint": "",
                                                  "model": "m", "cwd": str(tmp_path)}))
    (run.directory.parent / "666").symlink_to(planted)
    assert all(r.coordinator != "tcp://evil:1" for r in local_runs.live_runs())


def test_control_without_a_coordinator_or_a_local_run_says_what_to_pass(tmp_path):
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    env.pop("MEGATRON_SERVE_COORDINATOR", None)
    done = subprocess.run([sys.executable, "-m", "megatron_serve.cli", "control", "status"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip() == ("megatron-serve control: error: no --coordinator given and no `megatron-serve run` "
                                   "is running on this machine: start one, or pass --coordinator tcp://HOST:5555")


def hold_port(port: int) -> socket.socket | None:
    """Listen on ``port`` so that it is taken; ``None`` when something else already has it (taken anyway)."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as exc:
        sock.close()
        assert exc.errno == errno.EADDRINUSE
        return None
    sock.listen()
    return sock


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_make_run_with_5555_taken_picks_a_free_port_that_control_finds(tmp_path, tmp_path_factory):
    holder = hold_port(DEFAULT_PORT)
    http_port = free_port()
    # the session's cache of GGUF directories: the file's directory is made once a session (tests/realmodel make it too)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "runtime"),
           "XDG_CACHE_HOME": str(gguf_cache_home(tmp_path_factory))}
    env.pop("MEGATRON_SERVE_COORDINATOR", None)
    log = tmp_path / "make-run.log"
    make = ["make", "-C", str(ROOT), "--no-print-directory", "run", f"VENV={sys.prefix}",
            f"ARGS=--port {http_port} --log-dir {tmp_path / 'logs'}"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(make, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    try:
        def ready() -> bool:
            assert proc.poll() is None, log.read_text()
            return "megatron-serve is ready" in log.read_text()

        wait_until(ready, 480, "`make run` to serve", interval=0.5)
        text = log.read_text()
        assert f"{DEFAULT_PORT} is taken: using a free port" in text, text
        (published,) = local_runs_in(tmp_path / "runtime")
        port = int(published["coordinator"].rsplit(":", 1)[1])
        assert port != DEFAULT_PORT and f"coordinator listening on tcp://127.0.0.1:{port}" in text

        def control(*argv: str) -> str:
            done = subprocess.run([sys.executable, "-m", "megatron_serve.cli", "control", *argv], env=env,
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            return done.stdout

        status = control("status")
        assert f"tcp://127.0.0.1:{port}" in status and "state: RUNNING" in status
        assert "RUNNING: serving requests" in status
        assert "next: `megatron-serve control unpause` to serve again" in control("pause")
        assert json.loads(control("status", "--json"))["state"] == "PAUSED"
        assert "RUNNING" in control("unpause")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", timeout=120)
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1.gguf", max_tokens=16, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content, reply
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal
        proc.wait(timeout=120)
        assert "stopped" in log.read_text() and "Traceback" not in log.read_text()
        assert local_runs_in(tmp_path / "runtime") == []  # the run withdrew its address
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if holder is not None:
            holder.close()


def local_runs_in(runtime: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((runtime / "megatron-serve").glob("*/run.json"))]
