"""The coordinator loads no tokenizer: requests reach it as token ids, tokenized in the caller's process.

Its model directory is only named to clients (``HELLO_ACK``), which load the tokenizer themselves;
a directory whose tokenizer files are broken therefore costs the coordinator nothing.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from megatron_serve import cli
from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.tokenizer import Tokenizer
from megatron_serve.wire.sampling_params import SamplingParams

from ..helpers import Children, free_port

pytestmark = pytest.mark.timeout(180)


def _mapped_libraries(pid: int) -> set[str]:
    """The shared objects a live process has mapped (Linux): what native extensions it imported."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {Path(line.split()[-1]).name for line in lines if line.split()[-1].endswith(".so") or ".so." in line}


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads /proc/<pid>/maps (Linux)")
async def test_a_coordinator_with_broken_tokenizer_files_serves_prompts_its_clients_tokenized(tmp_path, tiny_model):
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model, broken)
    (broken / "tokenizer.json").write_text("{ this is not a tokenizer")
    tokenizer = Tokenizer.from_pretrained(tiny_model)
    children = Children(tmp_path)
    port = free_port()
    try:
        proc = children.coordinator(str(broken), port)
        async with InferenceClient(f"tcp://127.0.0.1:{port}", token=children.secret, tokenizer=tokenizer) as client:
            future = client.add_request("a text prompt, tokenized by the client", SamplingParams(), request_id="text")
            status = await client.status()
            deadline = asyncio.get_running_loop().time() + 30
            while status["queued"] != 1 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)  # poll until the SUBMIT is in (no engine: it stays queued)
                status = await client.status()
            assert status["queued"] == 1 and not future.done()  # accepted as ids, not refused
            tokenizing = [name for name in _mapped_libraries(os.getpid()) if "tokenizers" in name]
            assert tokenizing, "the control: this process loaded a tokenizer, and its library shows"
            assert not set(tokenizing) & _mapped_libraries(proc.pid)  # the coordinator never did
            client.abort("text")
            await asyncio.wait_for(future, 10)
        assert proc.poll() is None
    finally:
        children.kill_all()


def test_coordinator_command_refuses_a_model_directory_without_tokenizer_files(tmp_path, capsys):
    """The directory it names to clients must hold tokenizer files: a wrong path fails the start (a file check)."""
    assert cli.main(["coordinator", "--model", str(tmp_path / "no-model"), "--port", "0"]) == 1
    assert "no tokenizer.json or tokenizer_config.json in model directory" in capsys.readouterr().err
