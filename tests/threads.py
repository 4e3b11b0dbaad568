"""torch's default intra-op threads for the tests about arithmetic under threads.

The suite runs one OpenMP thread a process (tests/conftest.py), but a multi-threaded reduction can split its sums
differently from a single-threaded one, and batch invariance must hold under the threads a CPU engine runs with by
default: the invariance and kernel folders' tests, and every process they start, get one thread per core back.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch

#: torch's default: one intra-op thread per usable core.
DEFAULT_THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.fixture(autouse=True)
def default_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This test, and the processes it starts (they read ``OMP_NUM_THREADS``), at torch's default thread count."""
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", str(DEFAULT_THREADS))
    torch.set_num_threads(DEFAULT_THREADS)
    yield
    torch.set_num_threads(threads)
