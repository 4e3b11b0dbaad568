"""``benchmarks/startup_cpu.py`` on a real ``megatron-serve run``: every kind of process is found and measured, and
the light processes stay light (the run's own process imports no torch, the probe process no pydantic), as the
shared libraries each process has mapped show."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_serve.model.tiny import make_tiny_model
from tests.benchmarks.scripts import script_fixture

pytestmark = pytest.mark.timeout(300)

startup = script_fixture("startup", "startup_cpu_benchmark", "startup_cpu.py")


def mapped(pid: int, library: str) -> bool:
    """Whether process ``pid`` has a shared library whose file name holds ``library`` mapped."""
    return any(library in line.rsplit("/", 1)[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


def test_a_run_is_measured_per_kind_and_its_server_and_probe_processes_stay_light(startup, tmp_path):
    model = str(make_tiny_model(tmp_path / "tiny", seed=0))
    with startup.started(model, timeout=240) as run_pid:
        cpu = startup.settled(run_pid, timeout=120)
        assert {"run", "engine", "coordinator", "probe"} <= cpu.keys() and all(v > 0 for v in cpu.values())
        kinds = {startup.kind_of(pid): pid for pid in startup.descendants(run_pid)}
        assert mapped(kinds["engine"], "libtorch")  # what the check sees where torch is imported
        assert not mapped(run_pid, "libtorch")
        assert mapped(run_pid, "_pydantic_core")  # the HTTP server's request bodies
        assert not mapped(kinds["probe"], "_pydantic_core")
        assert not mapped(kinds["coordinator"], "libtorch")
