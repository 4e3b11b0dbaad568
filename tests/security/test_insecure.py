"""Without a fleet secret a coordinator refuses to start, unless ``--insecure`` says so; then it works as it
did before the fleet had secrets (benchmarks) and says in its log what that exposes."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys

import pytest

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.wire.sampling_params import SamplingParams

from ..helpers import free_port
from ..processes import stop_process_group
from ..server.conftest import wait_ready

pytestmark = pytest.mark.timeout(600)


def no_secret_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_SERVE_TOKEN"}
    return {**env, **extra}


def test_a_coordinator_without_a_secret_says_in_one_line_what_to_pass(tiny_model, tmp_path):
    done = subprocess.run([sys.executable, "-m", "megatron_serve.cli", "coordinator", "--model", tiny_model, "--port",
                           "0"], capture_output=True, text=True, timeout=120, env=no_secret_env())
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "needs the fleet secret: pass --token-file FILE or set $MEGATRON_SERVE_TOKEN" in done.stderr
    assert "or pass --insecure" in done.stderr
    short = tmp_path / "secret"
    short.write_text("hunter2\n")
    done = subprocess.run([sys.executable, "-m", "megatron_serve.cli", "engine", "--model", tiny_model,
                           "--coordinator", "tcp://127.0.0.1:1", "--token-file", str(short)],
                          capture_output=True, text=True, timeout=120, env=no_secret_env())
    assert done.returncode == 1 and f"--token-file {short}: the fleet secret has 7 characters" in done.stderr


@pytest.mark.slow
def test_an_insecure_run_works_as_before_and_says_so(tiny_model, tmp_path):
    port = free_port()
    output = tmp_path / "run.out"
    with open(output, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_serve.cli", "run", "--model", tiny_model, "--insecure", "--port",
             str(port), "--coordinator-port", "0", "--num-kv-blocks", "64", "--log-dir", str(tmp_path / "logs")],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env=no_secret_env(XDG_RUNTIME_DIR=str(tmp_path)), cwd=tmp_path)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", output)
        text = output.read_text()
        assert "INSECURE: no authentication, no encryption" in text and "WARNING --insecure" in text
        coordinator_log = (tmp_path / "logs" / "coordinator.log").read_text()
        assert "INSECURE (--insecure): no authentication and no encryption" in coordinator_log
        address = re.search(r"coordinator listening on (tcp://\S+)", text).group(1)
        assert not (tmp_path / "megatron-serve" / str(proc.pid) / "secret").exists()

        async def plain_client() -> list[int]:
            async with InferenceClient(address) as client:  # no secret, as before
                result = await client.add_request([5, 6, 7], SamplingParams(num_tokens_to_generate=3,
                                                                            ignore_eos=True))
                return result.generated_tokens

        assert len(asyncio.run(plain_client())) == 3
    finally:
        stop_process_group(proc)  # the run stops its fleet on SIGINT
