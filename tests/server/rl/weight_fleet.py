"""What the weight-route tests share: two tiny checkpoints, a served fleet of the first, a trainer process.

``checkpoints``: models A and B (same shapes, other seeds) and the greedy completions that a server started from
each answers (an in-process server per checkpoint, the reference; once per seed and session, shared by the xdist
workers, the models being deterministic). ``fleet``: ``megatron-serve run`` of A (a
coordinator, one engine process, the HTTP server) with the admin key and ``--weight-transfer-config`` gloo.
``run_trainer``: ``weight_trainer.py`` as a process of its own, the trainer side over real gloo and TCP (the
fleet's trainer: one such process for the module's runs, each run with its own session and group, forked from a fork
server that imported torch, so that torch is imported once per test worker, not once per module or run).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing.process
import os
import queue
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import IO

import httpx
import pytest
from filelock import FileLock

from megatron_serve.model.tiny import make_tiny_model
from megatron_serve.tokenizer import Tokenizer

from ...helpers import free_port, shared_directory
from ...forked import run_scripts, start_script
from ..conftest import admin_run, surface

ADMIN_KEY = "weights-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "1 2 3 4", "def add(a, b):"]
TOKENS = 8
TRAINER = Path(__file__).with_name("weight_trainer.py")
ANCHORED = Path(__file__).with_name("anchored.py")
ROOT = Path(__file__).parents[3]


def completion_body(model: str, prompt: str) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "return_epochs": True}


async def _served(model_dir: str) -> list[str]:
    """The greedy completions of a server started from ``model_dir``."""
    async with surface(model_dir, Tokenizer.from_pretrained(model_dir)) as (_, http):
        answers = [(await http.post("/v1/completions", json=completion_body("tiny-llama", p))).json()
                   for p in PROMPTS]
    return [answer["choices"][0]["text"] for answer in answers]


def reference_texts(seed: int, model_dir: str, shared: Path) -> list[str]:
    """The greedy completions of a server started from ``model_dir``, the tiny model of ``seed``: once per session,
    the first worker to need them keeps them in ``shared`` (the workers' common directory) for the others."""
    path = shared / f"weight-routes-reference-{seed}.json"
    with FileLock(f"{path}.lock"):
        if not path.exists():
            path.write_text(json.dumps(asyncio.run(_served(model_dir))))
        return json.loads(path.read_text())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("weight-routes")
    a, b = str(make_tiny_model(root / "a", seed=0)), str(make_tiny_model(root / "b", seed=1))
    shared = shared_directory(tmp_path_factory)
    texts = SimpleNamespace(a=reference_texts(0, a, shared), b=reference_texts(1, b, shared))
    assert texts.a != texts.b
    return SimpleNamespace(a=a, b=b, texts=texts)


@pytest.fixture(scope="module")
def fleet(checkpoints, tmp_path_factory):
    with admin_run(checkpoints.a, tmp_path_factory.mktemp("weight-routes-run"), ADMIN_KEY,
                   "--weight-transfer-config", '{"backend": "gloo"}') as url, \
            httpx.Client(base_url=url, timeout=300) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        with Trainer() as trainer:
            yield SimpleNamespace(url=url, http=http, model=model, path=checkpoints.a, trainer=trainer)


class Trainer:
    """``weight_trainer.py --serve``: the trainer process the module's runs share (its runs one at a time), forked
    from the test worker's fork server, which imported torch already (:mod:`tests.forked`); started at the
    first run (the frameworks' own clients, a module each, bring their own trainer side)."""

    proc: multiprocessing.process.BaseProcess | None = None

    def __enter__(self) -> "Trainer":
        return self

    def _start(self) -> None:
        self.errors = tempfile.NamedTemporaryFile("w+", prefix="weight-trainer-", suffix=".err")  # noqa: SIM115
        self.proc, self.stdin, stdout = start_script(TRAINER, ["--serve"], {"ADMIN_KEY": ADMIN_KEY},
                                                     self.errors.name)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(stdout,), daemon=True).start()

    def _read(self, stdout: IO[str]) -> None:
        with stdout:
            for line in stdout:
                self.lines.put(line)
        self.lines.put("")  # the process ended

    def __exit__(self, *_) -> None:
        if self.proc is None:
            return
        self.stdin.close()
        self.proc.join(30)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()
        self.errors.close()

    def stderr(self) -> str:
        self.errors.seek(0)
        return self.errors.read()[-3000:]

    def run(self, argv: list[str], timeout: float = 600) -> list[dict]:
        """One run's JSON lines; fails the test with the run's traceback if it raised."""
        if self.proc is None:
            self._start()
        assert self.proc is not None and self.proc.exitcode is None, self.stderr()
        self.stdin.write(json.dumps(argv) + "\n")
        lines: list[dict] = []
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"trainer run {argv} took over {timeout}s: {lines} {self.stderr()}") from None
            assert line, f"trainer exited during {argv}: {lines} {self.stderr()}"
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            if "trainer_done" in row:
                assert row["error"] is None, f"{lines}\n{row['error']}"
                return lines
            lines.append(row)


def completions(fleet: SimpleNamespace) -> tuple[list[str], set[int]]:
    """The fleet's greedy completions of :data:`PROMPTS`, and the epochs on all their tokens."""
    answers = [fleet.http.post("/v1/completions", json=completion_body(fleet.model, p)).json() for p in PROMPTS]
    choices = [answer["choices"][0] for answer in answers]
    return [c["text"] for c in choices], {epoch for c in choices for epoch in c["policy_epochs"]}


def epoch(fleet: SimpleNamespace) -> int:
    return fleet.http.get("/v1/admin/status", headers=ADMIN).json()["epoch"]


def run_trainer(fleet: SimpleNamespace, protocol: str, model_dir: str, *extra: str,
                env: dict[str, str] | None = None) -> list[dict]:
    """The trainer process for ``protocol`` (its calls and its broadcast); the JSON lines it printed (one per HTTP
    answer: ``{"call", "status", "body"}``). ``env``: more of its environment (a GPU of its own), in a process of
    its own; otherwise the fleet's :class:`Trainer` runs it."""
    if env is None and getattr(fleet, "trainer", None) is not None:
        return fleet.trainer.run([protocol, fleet.url, model_dir, str(free_port()), *extra])
    ended = subprocess.run([sys.executable, str(TRAINER), protocol, fleet.url, model_dir, str(free_port()), *extra],
                           capture_output=True, text=True, timeout=600,
                           env={**os.environ, "ADMIN_KEY": ADMIN_KEY, **(env or {})})
    lines = [json.loads(line) for line in ended.stdout.splitlines() if line.startswith("{")]
    assert ended.returncode == 0, ended.stdout[-3000:] + ended.stderr[-3000:]
    return lines


def answer(lines: list[dict], call: str) -> dict:
    """The last of a trainer's answers (:func:`run_trainer`'s lines) to ``call``."""
    return [line for line in lines if line["call"] == call][-1]


def assert_refused(lines: list[dict], call: str, corrupt: str, status: int) -> None:
    """``call`` refused the tensor that ``weight_trainer.py --corrupt corrupt`` spoilt with ``status``, and its
    message names what is wrong (the last tensor's dtype, name or shape)."""
    refused = answer(lines, call)
    assert refused["status"] == status, lines
    wrong = {"dtype": "int8", "name": "model.layers.99.mlp.nope.weight", "shape": "(3, 3)"}[corrupt]
    assert wrong in refused["body"]["error"]["message"], refused


def with_key(url: str, user: str) -> str:
    """``url`` with the admin key as HTTP Basic's password: the frameworks' aiohttp clients send no header of their
    own, but aiohttp and requests send a URL's credentials as Basic."""
    return url.replace("://", f"://{user}:{ADMIN_KEY}@", 1)


def run_framework(python: Path | str, runner: str, argv: list[str], anchors: str, package: str) -> dict:
    """A framework's own client code: the script ``runner`` (beside this module) under ``python``, with ``anchors``
    (the folder at the repository's root where ``make setup`` installs that framework beside the venv) first on
    ``PYTHONPATH``; the JSON of the last line it printed. Under this venv's Python the runner is forked from the fork
    server (:mod:`.anchored` puts ``anchors`` on its path), still a process of its own, whose framework imports
    never reach the test process, without importing torch again. Fails, saying what to run, where ``package`` is
    not installed there."""
    path = ROOT / anchors
    if not Path(python).exists() or not (path / package).is_dir():
        pytest.fail(f"{package} is not installed in {path} (or {python} is missing): run `make setup` (after "
                    "removing the venv's stamp, .venv/.installed-test or .venv-verl/.installed, where it predates the "
                    "framework)")
    search = os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")]))
    script = Path(__file__).with_name(runner)
    if Path(python) == Path(sys.executable):  # this venv's: forked from the fork server, torch imported already
        (ended,) = run_scripts(ANCHORED, [[str(path), str(script), *argv]], {"PYTHONPATH": search}, timeout=540,
                               via="forkserver")
        code, stdout, stderr = ended.returncode, ended.stdout, ended.stderr
    else:
        done = subprocess.run([str(python), str(script), *argv], capture_output=True, text=True, timeout=540,
                              env={**os.environ, "PYTHONPATH": search})
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    assert code == 0, stdout[-3000:] + stderr[-5000:]
    return json.loads(stdout.strip().splitlines()[-1])
