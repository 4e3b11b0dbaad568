"""Fixtures of the server suite: a tiny model and its tokenizer (once per session), apps served on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import httpx
import openai
import pytest

from megatron_serve import InferenceConfig, MegatronAsyncLLM
from megatron_serve.server import create_app
from megatron_serve.server.runner import bind_socket, serve_app
from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.tokenizer import Tokenizer

from ..helpers import free_port, poll_ready
from ..processes import start_cli, stop_process_group
from ..run_stack import RunStack, start_run


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("server-tiny") / "tiny-llama", seed=0))


@pytest.fixture(scope="session")
def tokenizer(tiny_model) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model)


@contextlib.asynccontextmanager
async def serving(app) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on a free port of 127.0.0.1 in this event loop; yields the base URL."""
    sock = bind_socket("127.0.0.1", 0)
    stop = asyncio.Event()
    started: asyncio.Future = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve_app(app, sock=sock, stop=stop,
                                         on_started=lambda url: started.done() or started.set_result(url)))
    done, _ = await asyncio.wait({task, started}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if started not in done:
        task.cancel()
        raise RuntimeError("the app did not start")
    try:
        yield started.result()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


@contextlib.asynccontextmanager
async def surface(tiny_model: str, tokenizer: Tokenizer, app_options: dict[str, Any] | None = None,
                  **config: Any) -> AsyncIterator[tuple[openai.AsyncOpenAI, httpx.AsyncClient]]:
    """The app over a ``MegatronAsyncLLM`` in direct mode (a real engine in this process), served; the official
    ``openai`` client and an HTTP client for it. ``config``: ``InferenceConfig`` fields; ``app_options``:
    ``create_app``'s."""
    settings = InferenceConfig(**{"block_size_tokens": 16, "num_kv_blocks": 256, **config})
    async with MegatronAsyncLLM(tiny_model, settings) as llm:
        app = create_app(llm.client, tokenizer, "tiny-llama", vocab_size=512, max_model_len=1024,
                         status_interval=0.05, **(app_options or {}))
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
            try:
                yield client, http
            finally:
                await client.close()


def wait_ready(proc: subprocess.Popen, url: str, output: Path, timeout: float = 240.0) -> None:
    """Poll ``url``/ready until 200; fail with the process's output if it exits or the time runs out."""
    poll_ready(url, timeout, lambda: None if proc.poll() is None else
               f"{proc.args} exited with {proc.returncode}:\n{output.read_text()}",
               lambda: f"{proc.args} not ready in time:\n{output.read_text()}")


@contextlib.contextmanager
def served_process(model: str, log_dir: Path, *extra: str,
                   env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """``megatron-serve run`` of ``model`` on a free port (its output and logs in ``log_dir``); yields its URL and
    process once ``/ready`` answers 200, and stops its process group after."""
    port = free_port()
    output = log_dir / "run.out"
    proc = start_cli(["run", "--model", model, "--port", str(port), "--coordinator-port", "0", "--num-kv-blocks",
                      "256", "--log-dir", str(log_dir), "--drain-timeout", "5", *extra], output, env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, output)
        yield url, proc
    finally:
        stop_process_group(proc)  # the run command stops its fleet on SIGINT


@contextlib.contextmanager
def served_run(model: str, log_dir: Path, *extra: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """:func:`served_process`'s URL."""
    with served_process(model, log_dir, *extra, env=env) as (url, _):
        yield url


@contextlib.contextmanager
def admin_run(model: str, log_dir: Path, admin_key: str, *extra: str,
              env: dict[str, str] | None = None) -> Iterator[str]:
    """:func:`served_run` with ``admin_key`` in a key file."""
    key_file = log_dir / "admin-key"
    key_file.write_text(admin_key + "\n")
    with served_run(model, log_dir, "--admin-key-file", str(key_file), *extra, env=env) as url:
        yield url


@contextlib.contextmanager
def runtime_lora_run(model: str, tmp: Path, admin_key: str, *extra: str, engines: int) -> Iterator[RunStack]:
    """:func:`~tests.run_stack.start_run` of ``model`` under ``tmp`` with LoRA (up to rank 16) loaded and unloaded
    while it serves (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, ``admin_key`` in a key file); after, its group is
    stopped and every child killed, whatever state the tests left."""
    key_file = tmp / "admin-key"
    key_file.write_text(admin_key)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        run = start_run(model, tmp / "run", "--enable-lora", "--max-lora-rank", "16", "--admin-key-file",
                        str(key_file), *extra, engines=engines)
    try:
        yield run
    finally:
        stop_process_group(run.proc)
        run.kill()


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text (``labels`` like ``status="aborted"``)."""
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" ([0-9.e+-]+)$"
    for line in text.splitlines():
        match = re.match(pattern, line)
        if match:
            return float(match.group(1))
    raise KeyError(f"{name}{{{labels}}} not in the metrics")
