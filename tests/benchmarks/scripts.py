"""The benchmark scripts for their tests: loaded as modules (one module-scoped fixture per script, made here), or run
as ``__main__`` in a child forked from the test's process (:func:`run_script`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.forked import Ended, run_scripts
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


def run_script(file: str, *argv: str, timeout: float = 300, env: dict[str, str] | None = None) -> Ended:
    """``python benchmarks/FILE ARGV`` in a child forked from this process, which has imported torch already: a fresh
    interpreter spends ~2 CPU-s on that import, more than a smoke run's own work (:func:`tests.forked.run_scripts`;
    the child runs the exit functions the script registered, its scratch directory's removal). ``env``: variables
    read while the script runs (``TMPDIR``). One still running after ``timeout`` seconds is killed, and the test then
    fails on what it printed: the default stays below the suite's 360-s test limit, past which a hung script's
    output was lost (a host-ceiling sweep that hung in a warm suite here). Where this
    process has CUDA up, which a forked child cannot use, the script runs in a fresh interpreter instead."""
    script = BENCHMARKS / file
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        try:
            done = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True,
                                  timeout=timeout, env={**os.environ, **(env or {})})
        except subprocess.TimeoutExpired as exc:
            return Ended(-signal.SIGKILL, str(exc.stdout or ""), str(exc.stderr or ""))
        return Ended(done.returncode, done.stdout, done.stderr)
    (ended,) = run_scripts(script, [list(argv)], env or {}, timeout, via="fork", exit_functions=True)
    return ended
