"""The benchmark scripts for their tests: loaded as modules (one module-scoped fixture per script, made here), or run
as ``__main__`` in a child forked from the test's process (:func:`run_script`)."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.helpers import script_module

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def script_fixture(fixture: str, module: str, file: str) -> Any:
    """A module-scoped fixture named ``fixture``: ``benchmarks/FILE`` loaded as the module ``module`` while the test
    module runs (:func:`tests.helpers.script_module`). Assign it to a name in the test module, as pytest finds it."""
    @pytest.fixture(scope="module", name=fixture)
    def loaded() -> Iterator[ModuleType]:
        with script_module(module, BENCHMARKS / file) as script:
            yield script

    return loaded


@dataclass(frozen=True)
class Ran:
    """How a script run by :func:`run_script` ended: its exit code (minus the signal that killed it) and output."""

    returncode: int
    stdout: str
    stderr: str


def run_script(file: str, *argv: str, timeout: float = 600, env: dict[str, str] | None = None) -> Ran:
    """``python benchmarks/FILE ARGV`` in a child forked from this process, which has imported torch already: a fresh
    interpreter spends ~2 CPU-s on that import, more than a smoke run's own work. The child runs the script as
    ``__main__`` with the script's folder first on its path, files of its own for stdout and stderr, no logging
    handler of pytest's, and at its end the exit functions the script registered (its scratch directory's removal),
    none of this process's. ``env``: variables read while the script runs (``TMPDIR``); those read at import
    (``OMP_*``) are this process's. One still running after ``timeout`` seconds is killed. Where this process has
    CUDA up, which a forked child cannot use, the script runs in a fresh interpreter instead."""
    script = BENCHMARKS / file
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        try:
            done = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True,
                                  timeout=timeout, env={**os.environ, **(env or {})})
        except subprocess.TimeoutExpired as exc:
            return Ran(-signal.SIGKILL, str(exc.stdout or ""), str(exc.stderr or ""))
        return Ran(done.returncode, done.stdout, done.stderr)
    with tempfile.TemporaryDirectory(prefix="bench-script-") as logs:
        out, err = Path(logs, "out"), Path(logs, "err")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_in_child(script, list(argv), out, err, env or {})
        pidfd = os.pidfd_open(pid)
        try:
            if not select.select([pidfd], [], [], timeout)[0]:
                os.kill(pid, signal.SIGKILL)
        finally:
            os.close(pidfd)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        return Ran(code, out.read_text(errors="replace"), err.read_text(errors="replace"))


def _run_in_child(script: Path, argv: list[str], out: Path, err: Path, env: dict[str, str]) -> None:
    """The forked child of :func:`run_script`: the script as a process of its own would run it, then ``os._exit``
    with its code. Never returns."""
    code, cleared = 1, False
    gc.freeze()  # the test process's heap, inherited: none of the script's collections walks (and copies) it
    try:
        for fd, path in ((1, out), (2, err)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - pytest's capture objects are the parent's
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        logging.getLogger().handlers.clear()  # pytest's capture handler: the script's basicConfig writes to stderr
        atexit._clear()  # this process's exit functions are the parent's business
        cleared = True
        os.environ.update(env)
        tempfile.tempdir = None  # read again, from TMPDIR as env has it
        sys.argv = [str(script), *argv]
        sys.path.insert(0, str(script.parent))
        try:
            runpy.run_path(str(script), run_name="__main__")
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the child's traceback, for the test's failure message
        traceback.print_exc()
    finally:
        if cleared:
            atexit._run_exitfuncs()  # the script's own, failed or not
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
