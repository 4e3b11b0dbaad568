"""A real ``megatron-serve run`` for fault tests: start it, find its children, stream from it, hurt it.

Requests go two ways: over HTTP (``logprobs: 0``, so that every chunk says how many tokens it
carries), and through an ``InferenceClient`` of the run's coordinator, whose partials carry token
ids: a stream that moved to another engine is compared id by id with a quiet run. (The text of a
moved HTTP stream is the detokenizer's business, tested with the output path.)
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.commands.local_runs import RUN_FILE, SECRET_FILE

from tests.helpers import http_get, poll, poll_ready, process_children


@dataclass
class Outcome:
    """What one HTTP request got: its tokens and text, how it finished, or the error it ended with."""

    tokens: list[str] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: dict | None = None  # an error event, or an error answer's body
    status: int | None = None
    finals: int = 0  # chunks with a finish_reason: exactly one for a request that completed

    @property
    def completed(self) -> bool:
        return self.error is None and self.finals == 1 and self.finish_reason is not None


@dataclass
class RunStack:
    proc: subprocess.Popen
    url: str
    model: str
    log: Path
    tmp: Path  # the run's TMPDIR (its own directory is made there) and XDG_RUNTIME_DIR (its published file)
    env: dict[str, str]  # for commands that should find this run: `megatron-serve control` without --coordinator

    def children(self) -> dict[str, list[int]]:
        """The run's live children by role (``coordinator``, ``engine``, and the ``launcher`` that forks its engines),
        from /proc."""
        found: dict[str, list[int]] = {"coordinator": [], "engine": [], "launcher": []}
        for pid in child_pids(self.proc.pid):
            role = role_of(pid)
            if role in found:
                found[role].append(pid)
        return found

    def one(self, role: str) -> int:
        pids = self.children()[role]
        assert pids, f"no live {role} under run {self.proc.pid}"
        return pids[0]

    def control(self, *argv: str) -> str:
        """``megatron-serve control ARGV`` against this run (found by its published file); its output."""
        done = subprocess.run([sys.executable, "-m", "megatron_serve.cli", "control", *argv], env=self.env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def pids(self) -> list[int]:
        return [pid for pids in self.children().values() for pid in pids]

    def kill(self) -> None:
        """Teardown, whatever state the tests left: the run and every child are gone (stopped ones too)."""
        pids = self.pids()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)

    def _published(self) -> Path:
        """The run's directory where ``control`` finds it (``$XDG_RUNTIME_DIR/megatron-serve/<pid>``)."""
        return self.tmp / "megatron-serve" / str(self.proc.pid)

    def published(self) -> dict[str, Any]:
        """What the run published for ``control`` once its ports were bound (its coordinator, its endpoint...);
        ``OSError`` before (the file is written aside and renamed: whole or absent)."""
        return json.loads((self._published() / RUN_FILE).read_text())

    def coordinator(self) -> str:
        """The coordinator's address, from the file the run published for ``control``."""
        return self.published()["coordinator"]

    def secret(self) -> str:
        """The run's fleet secret, from its private run directory (as ``control`` reads it)."""
        return (self._published() / SECRET_FILE).read_text().strip()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def ready(self) -> dict:
        return http_get(f"{self.url}/ready", timeout=10).json()

    async def wait_engines(self, count: int, timeout: float) -> float:
        """Poll ``/ready`` until ``count`` engines serve, each one of this run's live engine processes (a
        dead engine the coordinator has not noticed yet counts in ``/ready``); returns how long it took."""
        began = time.monotonic()
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as http:
            while True:
                try:
                    body = (await http.get("/ready")).json()
                    if body["ready"] and body["engines"] == count and await self._engines_alive():
                        return time.monotonic() - began
                except (httpx.TransportError, OSError, TimeoutError):  # the coordinator may be restarting
                    pass
                assert time.monotonic() - began < timeout, f"{count} engines not back within {timeout}s: " \
                                                            f"{self.output()[-3000:]}"
                await asyncio.sleep(0.2)


    async def _engines_alive(self) -> bool:
        """Whether every engine the coordinator lists is a live engine process of this run."""
        async def listed() -> list[dict[str, Any]]:
            async with InferenceClient(self.coordinator(), self.secret(), role="control") as control:
                return (await control.status())["engines"]

        engines = await asyncio.wait_for(listed(), 15)
        return {engine["info"].get("pid") for engine in engines} <= set(self.children()["engine"])


def run_environment(tmp: Path) -> dict[str, str]:
    """This process's environment for a command of its own under ``tmp``: its TMPDIR and XDG_RUNTIME_DIR (where a run
    publishes itself for ``control``), and no ``MEGATRON_SERVE_COORDINATOR`` inherited from the caller."""
    env = {**os.environ, "TMPDIR": str(tmp), "XDG_RUNTIME_DIR": str(tmp)}
    env.pop("MEGATRON_SERVE_COORDINATOR", None)
    return env


def start_run(model: str, tmp: Path, *extra: str, engines: int = 2, close_stdout_after: int | None = None,
              api_key: str | None = None) -> RunStack:
    """``megatron-serve run`` as a user starts it; ``close_stdout_after``: read that many lines, then close the
    pipe (as ``run ... | head -2`` does); ``api_key``: the one ``extra`` sets. Returns once ``/ready`` answers 200.

    It listens on a port the kernel gives it (``--port 0``), read from the file it publishes for ``control``: a port
    picked free here and bound later by the run could meanwhile be taken by another test's stack (a socket bound
    but not listening does not stop a second bind), and this test would then talk to that stack."""
    tmp.mkdir(parents=True, exist_ok=True)
    log = tmp / "run.log"
    env = run_environment(tmp)
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_serve.cli", "run", "--model", model, "--engines", str(engines),
             "--port", "0", "--coordinator-port", "0", "--num-kv-blocks", "256", "--max-requests", "64",
             "--log-level", "INFO", *extra],
            stdout=subprocess.PIPE if close_stdout_after else err, stderr=err, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True)
    if close_stdout_after:
        for _ in range(close_stdout_after):
            proc.stdout.readline()
        proc.stdout.close()
    stack = RunStack(proc, "", model="", log=log, tmp=tmp, env=env)

    def dead() -> str | None:
        return None if proc.poll() is None else f"run exited with {proc.returncode}: {stack.output()[-3000:]}"

    def endpoint() -> str | None:
        try:
            return stack.published()["endpoint"].removesuffix("/v1")
        except OSError:  # not published yet
            return None

    stack.url = poll(endpoint, 300, dead, lambda: f"run {proc.pid} published no URL: {stack.output()[-3000:]}", 0.1)
    poll_ready(stack.url, 300, dead, lambda: stack.output()[-3000:])
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    stack.model = http_get(f"{stack.url}/v1/models", headers=auth, timeout=10).json()["data"][0]["id"]
    return stack


#: The module of the process that forks a local fleet's engines (runtime/megatron_serve/commands/launcher.py).
LAUNCHER = "megatron_serve.commands.launcher"


def child_pids(parent: int) -> list[int]:
    """Children of every thread of ``parent`` (the local fleet starts them from a thread of its own), and the
    children of its engine launcher among them (the engines and rendezvous stores it forked)."""
    pids = process_children(parent)
    return pids + [child for pid in pids if LAUNCHER in command_line(pid) for child in child_pids(pid)]


def command_line(pid: int) -> list[str]:
    """Process ``pid``'s command line ([] once it is gone), as a forked engine's title reads too: one string its
    launcher set (setproctitle), the words split at spaces, as ``ps`` shows it."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().rstrip(b"\0").decode(errors="replace").split("\0")
    except OSError:
        return []
    return argv[0].split(" ") if len(argv) == 1 else argv


def role_of(pid: int) -> str | None:
    argv = command_line(pid)
    try:
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                return None  # dead, not yet reaped
    except OSError:
        return None
    if LAUNCHER in argv:
        return "launcher"
    if "megatron_serve.cli" not in argv:
        return None
    return argv[argv.index("megatron_serve.cli") + 1]


def alive(pid: int) -> bool:
    return role_of(pid) is not None


async def complete(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Outcome:
    """A non-streamed greedy completion with its tokens."""
    response = await http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0, "ignore_eos": True, "logprobs": 0})
    if response.status_code != 200:
        return Outcome(error=response.json().get("error"), status=response.status_code)
    choice = response.json()["choices"][0]
    return Outcome(tokens=choice["logprobs"]["tokens"], text=choice["text"], finish_reason=choice["finish_reason"],
                   status=200, finals=1)


async def stream(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                 first: asyncio.Event | None = None) -> Outcome:
    """A streamed greedy completion: its tokens and text as they came, and how it ended; ``first`` is set at
    its first chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": True}
    outcome = Outcome()
    async with http.stream("POST", "/v1/completions", json=body) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            outcome.error = json.loads(await response.aread()).get("error")
            return outcome
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                outcome.error = chunk["error"]
                continue
            for choice in chunk["choices"]:
                outcome.text += choice["text"]
                outcome.tokens += (choice.get("logprobs") or {}).get("tokens") or []
                if choice.get("finish_reason"):
                    outcome.finish_reason = choice["finish_reason"]
                    outcome.finals += 1
            if first is not None:
                first.set()
    return outcome


def restart_lines(output: str, role: str) -> list[str]:
    """The run's log lines saying a child of ``role`` died and is restarted."""
    return [line for line in output.splitlines() if re.search(rf"{role}( \d+ \(group \d+\))? died \(", line)]


@dataclass
class Streamed:
    """What one client stream got: token ids as they came, and its final request (or the error it ended with)."""

    tokens: list[int] = field(default_factory=list)
    final: Any = None
    error: BaseException | None = None

    @property
    def completed(self) -> bool:
        return self.error is None and self.final is not None and self.final.status.name == "COMPLETED"


async def client_stream(client: Any, prompt: str, max_tokens: int, first: asyncio.Event | None = None) -> Streamed:
    """A greedy stream through an ``InferenceClient``; ``first`` is set at its first partial."""
    from megatron_serve.client.coordinator_client import StreamPartial
    from megatron_serve.wire.sampling_params import SamplingParams

    out = Streamed()
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=max_tokens, ignore_eos=True)
    try:
        async for item in client.add_request_streaming(prompt, params):
            if isinstance(item, StreamPartial):
                out.tokens += item.new_tokens
                if first is not None:
                    first.set()
            else:
                out.final = item
    except Exception as exc:  # noqa: BLE001 - the outcome is what is checked
        out.error = exc
    return out
