"""The stack's ports (``--port``, ``--health-port``, ``--coordinator-port``) are chosen and checked together before
any model loads.

``serve MODEL --port P --coordinator-port P+1`` used to bind the probe port's default (``--port`` + 1)
before the coordinator's child bound P+1; both sockets asked ``SO_REUSEADDR`` and neither listened
yet, so the clash showed only once the model had loaded, as a 30-line traceback. Here the real
command starts and serves, with its probe port elsewhere; two options that name one port are
refused in one line before anything starts; the defaults give way to each other.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from megatron_serve.commands import stack_ports
from megatron_serve.commands.stack_ports import reserve_ports

from tests.helpers import free_port
from tests.processes import start_cli
from tests.run_stack import run_environment


def adjacent_free_ports() -> int:
    """A port P such that P and P + 1 are free (now)."""
    for _ in range(100):
        port = free_port()
        if port < 65535:
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise AssertionError("no two adjacent free ports")


@pytest.mark.timeout(400)
def test_serve_with_the_coordinator_on_port_plus_one_starts_and_serves(tiny_llama, tmp_path):
    port = adjacent_free_ports()
    log = tmp_path / "serve.log"
    proc = start_cli(["serve", tiny_llama, "--port", str(port), "--coordinator-port", str(port + 1), "--num-kv-blocks",
                      "64"], log, run_environment(tmp_path))
    try:
        deadline = time.monotonic() + 300
        while "megatron-serve is ready" not in log.read_text():
            assert proc.poll() is None, f"serve exited with {proc.returncode}: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        text = log.read_text()
        assert f"coordinator listening on tcp://127.0.0.1:{port + 1}" in text, text
        assert f"the probe port {port + 1} (--port + 1) is --coordinator-port: using a free port" in text, text
        probe_url = text.split("/health and /ready also on ", 1)[1].split()[0]
        assert probe_url != f"http://127.0.0.1:{port + 1}"
        assert httpx.get(f"{probe_url}/health", timeout=10).status_code == 200
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                            json={"model": model, "prompt": "Hello", "max_tokens": 3}, timeout=120)
        assert answer.status_code == 200, answer.text
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        assert "Traceback" not in log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("ports, message", [
    (lambda p: ["--port", p, "--coordinator-port", p],
     "--coordinator-port {p} is also --port: the coordinator and the HTTP server need a port each"),
    (lambda p: ["--port", "0", "--health-port", p, "--coordinator-port", p],
     "--coordinator-port {p} is also --health-port: the coordinator and the probe port need a port each"),
])
def test_two_options_naming_one_port_are_refused_in_one_line_before_anything_starts(tiny_llama, tmp_path, ports,
                                                                                   message):
    port = str(free_port())
    done = subprocess.run([sys.executable, "-m", "megatron_serve.cli", "run", "--model", tiny_llama, *ports(port)],
                          capture_output=True, text=True, timeout=120, env=run_environment(tmp_path),
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 1
    assert done.stderr.strip() == f"megatron-serve run: error: {message.format(p=port)} " \
                                  "(choose another --coordinator-port)", done.stderr
    assert "[1/4]" not in done.stdout  # nothing started
    assert not list(tmp_path.glob("megatron-fleet-*"))


def test_a_taken_explicit_coordinator_port_is_refused_before_the_sockets_are_bound():
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:
        with pytest.raises(ValueError, match=r"cannot listen on 127\.0\.0\.1:\d+: .*choose another --coordinator-port"):
            reserve_ports("127.0.0.1", 0, None, held.getsockname()[1])
    finally:
        held.close()


@pytest.mark.parametrize("offset", [0, 1])
def test_the_coordinators_default_gives_way_to_the_http_and_probe_ports(monkeypatch, offset):
    """``--port`` on the coordinator's default (``offset`` 0), or just below it (1: the probe port's default is then
    the coordinator's): the coordinator takes a free port rather than one the HTTP server or the probe port holds
    (bound, not yet listening: the coordinator's own bind would not have seen it)."""
    default = adjacent_free_ports() + 1
    monkeypatch.setattr(stack_ports, "DEFAULT_PORT", default)
    ports = reserve_ports("127.0.0.1", default - offset, None, None)
    try:
        held = {"--port": ports.http.getsockname()[1], "--health-port": ports.probe.getsockname()[1]}
        assert held == {"--port": default - offset, "--health-port": default - offset + 1}
        assert ports.coordinator == 0
        flag = "--port" if offset == 0 else "--health-port"
        assert ports.coordinator_note == f" ({default} is {flag}: using a free port)"
    finally:
        ports.close()
