"""A CPU kernel's load is not held up forever by torch's build lock file that a killed process left behind.

torch takes that file at every load of a library (ninja then has nothing to do) and waits while it exists; a process
SIGKILLed while holding it (an engine killed in its first step, which fault tests do) left every later engine waiting
in ``FileBaton.wait`` for good: a CI run here had engines of three test files stalled for minutes behind one such
file. megatron_kernels.cpu_build takes an flock of its own first, which dies with its holder, and removes a lock
file it finds under it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megatron_kernels import cpu_build

LOAD = "from megatron_kernels import cpu_build; print(cpu_build.built('silu_and_mul'))"


def _load_with(extensions: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)}
    return subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=240)


def test_a_lock_file_left_by_a_dead_process_does_not_stop_the_next_load(tmp_path: Path) -> None:
    first = _load_with(tmp_path)  # builds the library (a compiler cache makes the build cheap where it has it)
    assert first.stdout.split() == ["True"], first.stderr
    name = f"megatron_cpu_silu_and_mul_{cpu_build.build_tag(cpu_build.CSRC / 'silu_and_mul.cpp')}"
    (tmp_path / name / "lock").touch()  # what a process SIGKILLed inside torch's load leaves behind
    again = _load_with(tmp_path)  # without the flock: torch's FileBaton.wait until the 240 s time-out
    assert again.stdout.split() == ["True"], again.stderr
    assert not (tmp_path / name / "lock").exists()
