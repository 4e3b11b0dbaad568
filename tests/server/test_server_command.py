"""``megatron-serve server`` as a process: up before its coordinator, reachable once it answers (ready only with an
engine), 503 while stopped.

No engines are started: reachability, the missing engines and the 503 decisions come from the coordinator alone.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import httpx
import pytest

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.wire.security import make_secret

from ..helpers import http_get, http_post, wait_until
from .test_openai_e2e import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


SECRET = make_secret()  # the fleet's: every process here gets it in its environment


def spawn(args: list[str], log, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatron_serve.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "MEGATRON_SERVE_TOKEN": SECRET, **(env or {})})


def control(address: str, verb: str):
    async def go():
        client = InferenceClient(address, token=SECRET, role="control")
        await client.start(timeout=30)
        try:
            return await getattr(client, verb)(timeout=30)
        finally:
            client.close()

    return asyncio.run(go())


def test_server_before_coordinator_then_ready_then_stopped(tiny_model, tmp_path):
    key_file = tmp_path / "api-key"
    key_file.write_text("k3y\n")
    http_port, coordinator_port = free_port(), free_port()
    address = f"tcp://127.0.0.1:{coordinator_port}"
    url = f"http://127.0.0.1:{http_port}"
    auth = {"Authorization": "Bearer k3y"}
    body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 2}
    procs: list[subprocess.Popen] = []
    with open(tmp_path / "server.log", "wb") as server_log, open(tmp_path / "coordinator.log", "wb") as coord_log:
        try:
            server = spawn(["server", "--model", tiny_model, "--coordinator", address, "--host", "127.0.0.1",
                            "--port", str(http_port), "--api-key-file", str(key_file)], server_log,
                           env={"MEGATRON_SERVE_API_KEY": "not-this-one"})
            procs.append(server)

            def up() -> bool:
                assert server.poll() is None, (tmp_path / "server.log").read_text()
                try:
                    return http_get(f"{url}/health", timeout=2).status_code == 200
                except httpx.TransportError:
                    return False

            wait_until(up, 120, "the server to answer /health", interval=0.2)
            ready = http_get(f"{url}/ready")
            assert ready.status_code == 503 and ready.json()["coordinator_reachable"] is False
            answer = http_post(f"{url}/v1/completions", json=body, headers=auth)
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "coordinator_unreachable"
            assert http_post(f"{url}/v1/completions", json=body,
                              headers={"Authorization": "Bearer not-this-one"}).status_code == 401  # file wins

            procs.append(spawn(["coordinator", "--model", tiny_model, "--host", "127.0.0.1", "--port",
                                str(coordinator_port)], coord_log))
            wait_until(lambda: http_get(f"{url}/ready").json()["coordinator_reachable"], 120, "reachable",
                       interval=0.2)
            # reachable and RUNNING, but no engine can take a request: not ready, and it says what is missing
            assert http_get(f"{url}/ready").json() == {
                "ready": False, "state": "RUNNING", "coordinator_reachable": True, "busy": False, "engines": 0,
                "held": False, "detail": "no engine can take a request: none is registered with the coordinator",
                "missing": ["engines"]}
            assert http_get(f"{url}/health").json() == {"status": "ok", "missing": ["engines"]}

            control(address, "stop")
            wait_until(lambda: http_get(f"{url}/ready").json()["state"] == "STOPPED", 30, "stopped")
            assert http_get(f"{url}/ready").json()["missing"] == ["fleet", "engines"]
            answer = http_post(f"{url}/v1/completions", json=body, headers=auth)
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "fleet_stopped"
            control(address, "unpause")
            wait_until(lambda: http_get(f"{url}/ready").json()["state"] == "RUNNING", 30, "running again")

            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=30) == 0
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
