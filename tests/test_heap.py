"""The start-up heap stays frozen through the interpreter's last collection, except where Triton needs it thawed.

Thawed at exit, the last collection walked the whole start-up heap: 2-3 of the 5 seconds an idle
``megatron-serve run`` took to stop. A process that loaded Triton still thaws it (frozen objects are never
finalized, and Triton's nanobind extension prints a leak report)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import atexit, gc, sys
atexit.register(lambda: print(gc.get_freeze_count() > 0))  # runs last: registered first
if sys.argv[1] == "triton":
    import triton  # noqa: F401
from megatron_serve.heap import freeze_startup_heap
freeze_startup_heap()
"""


@pytest.mark.parametrize("loads,frozen", [("nothing", "True"), ("triton", "False")])
def test_the_heap_is_thawed_at_exit_only_where_triton_was_loaded(loads, frozen):
    done = subprocess.run([sys.executable, "-c", PROBE, loads], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == frozen
