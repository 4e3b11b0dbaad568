"""A local fleet supervises its children and takes them with it, with a stand-in interpreter for speed.

The children are a stand-in for ``python`` (``LocalFleet(python=...)``) that holds the lifeline the
way ``megatron-serve`` does, records each start and then sleeps: what is tested is the fleet's
handling of real processes (signals, restarts, parent death, its directory), not a model.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from megatron_serve.processes.lifeline import Lifeline
from megatron_serve.fleet.local_fleet import LocalFleet, remove_stale_run_dirs

from ..helpers import alive, wait_until

pytestmark = pytest.mark.timeout(120)

STANDIN = textwrap.dedent("""\
    #!{python}
    import json, os, sys, time
    from megatron_serve.processes.lifeline import hold_lifeline
    hold_lifeline()
    args = sys.argv[3:]  # after "-m megatron_serve.cli"
    with open({record!r}, "a") as f:
        f.write(json.dumps({{"role": args[0], "pid": os.getpid(), "args": args}}) + "\\n")
    if args[0] == "coordinator":
        with open(args[args.index("--address-file") + 1], "w") as f:
            f.write("tcp://127.0.0.1:" + (args[args.index("--port") + 1] if args[args.index("--port") + 1] != "0"
                                          else "45999"))
    if os.environ.get("STANDIN_EXIT") == "0" and args[0] == "engine" and "1" == args[args.index("--group") + 1]:
        sys.exit(0)
    time.sleep(120)
""")


def install_standin(tmp_path: Path, script: str) -> tuple[Path, Callable[[], list[dict]]]:
    """``script`` (a template of ``python`` and ``record``) as an executable ``python`` in ``tmp_path``, and a reader
    of the starts its children record."""
    record = tmp_path / "starts.jsonl"
    python = tmp_path / "python"
    python.write_text(script.format(python=sys.executable, record=str(record)))
    python.chmod(0o755)

    def starts() -> list[dict]:
        return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []

    return python, starts


@pytest.fixture
def standin(tmp_path):
    return install_standin(tmp_path, STANDIN)


def test_a_child_that_dies_is_restarted_with_back_off_and_its_cause_in_the_log(standin, tmp_path, caplog,
                                                                               monkeypatch):
    python, starts = standin
    monkeypatch.setenv("STANDIN_EXIT", "0")  # engine 1 exits 0 once started: it did what it was asked
    caplog.set_level(logging.WARNING, "megatron_serve.local_fleet")
    fleet = LocalFleet(tmp_path / "model", 2, python=str(python), log_dir=tmp_path / "logs")
    try:
        fleet.start(timeout=60)
        wait_until(lambda: len(starts()) == 3, 60, "the coordinator and both engines")
        fleet.supervise()
        first = next(s for s in starts() if s["role"] == "engine" and "0" in s["args"][-1:])
        os.kill(first["pid"], signal.SIGKILL)
        wait_until(lambda: len(starts()) == 4, 30, "engine 0 started again")
        os.kill(starts()[-1]["pid"], signal.SIGKILL)  # again at once: the next back-off doubles
        wait_until(lambda: len(starts()) == 5, 30, "engine 0 started a third time")
        coordinator = starts()[0]
        os.kill(coordinator["pid"], signal.SIGKILL)
        wait_until(lambda: len(starts()) == 6, 30, "the coordinator started again")
    finally:
        fleet.kill()
    engines = [s for s in starts() if s["role"] == "engine"]
    groups = [e["args"][-1] for e in engines]
    assert sorted(groups[:2]) == ["0", "1"] and groups[2:] == ["0", "0"]  # the same group each time; 1 exited 0
    group_zero = [e["args"] for e in engines if e["args"][-1] == "0"]  # engine 1 may have started first
    assert len(group_zero) == 3 and all(args == group_zero[0] for args in group_zero)
    restarted = starts()[-1]
    assert restarted["role"] == "coordinator" and "45999" in restarted["args"]  # the port it got, not 0 again
    assert fleet.restarts == {"engine 0 (group 0)": ["killed by SIGKILL", "killed by SIGKILL"],
                              "coordinator": ["killed by SIGKILL"]}
    lines = [r.getMessage() for r in caplog.records]
    assert any("engine 0 (group 0) died (killed by SIGKILL" in line and "restarting it in 0.5s (restart 1" in line
               for line in lines), lines
    assert any("restarting it in 1.0s (restart 2" in line for line in lines), lines
    assert any("engine 1 (group 1) exited normally (exit code 0): it is not restarted" in line for line in lines)
    assert not any(alive(s["pid"]) for s in starts())


def test_children_die_with_the_fleets_process_and_its_directory_goes_with_the_next_fleet(standin, tmp_path):
    """``kill -9`` of the parent: every child ends within seconds, and the next fleet removes the directory."""
    python, starts = standin
    runs = tmp_path / "tmp"
    runs.mkdir()
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""\
            import sys, time
            from megatron_serve.fleet.local_fleet import LocalFleet
            fleet = LocalFleet({str(tmp_path / 'model')!r}, 2, python={str(python)!r})
            fleet.start(timeout=60)
            print(fleet.log_dir, flush=True)
            time.sleep(120)
            """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(runs)})
    try:
        run_dir = Path(parent.stdout.readline().strip())
        wait_until(lambda: len(starts()) == 3, 60, "the coordinator and both engines")
        assert run_dir.parent == runs and (run_dir / "coordinator.log").exists()
        assert remove_stale_run_dirs(runs) == []  # its fleet lives: left alone
        parent.kill()
        parent.wait()
        wait_until(lambda: not any(alive(s["pid"]) for s in starts()), 10, "no child left")
    finally:
        parent.kill()
        for s in starts():
            if alive(s["pid"]):
                os.kill(s["pid"], signal.SIGKILL)
    (runs / "megatron-fleet-not-a-fleet").mkdir()  # no lock: not known to be a fleet's, left alone
    assert remove_stale_run_dirs(runs) == [run_dir] and not run_dir.exists()
    assert (runs / "megatron-fleet-not-a-fleet").exists()


def test_a_stopped_fleet_removes_its_own_directory_but_not_a_given_one(standin, tmp_path, monkeypatch):
    python, _ = standin
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    own = LocalFleet(tmp_path / "model", 1, python=str(python))
    given = LocalFleet(tmp_path / "model", 1, python=str(python), log_dir=tmp_path / "logs")
    for fleet in (own, given):
        fleet.start(timeout=60)
        fleet.stop(timeout=5)
    assert not own.log_dir.exists() and own.log_dir.parent == tmp_path
    assert (tmp_path / "logs" / "coordinator.log").exists()


def test_the_lifeline_pipe_alone_ends_a_child_whose_parent_cut_it():
    """The second line, for systems without a parent-death signal: end-of-file on the pipe ends the child."""
    lifeline = Lifeline()
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""\
            import time
            from megatron_serve.processes import lifeline
            lifeline.parent_death_signal = lambda *args: False  # as where prctl does not exist
            lifeline.hold_lifeline()
            print("holding", flush=True)
            time.sleep(60)
            """)], env={**os.environ, **lifeline.env()}, pass_fds=lifeline.pass_fds(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "holding"
        lifeline.close()
        assert child.wait(timeout=10) == 1
        assert "the parent process is gone: exiting" in child.stderr.read()
    finally:
        child.kill()
        child.wait()
