"""The forked children of the tests (``tests/forked.py``): a script's exit code, output and exit functions come back as
a process's would, ranks' reports and failures come back to the test's process, and a child past its time-out is
killed rather than left waiting (as a rank waits for a peer that failed)."""

from __future__ import annotations

import atexit
import os
import signal
import time
from pathlib import Path

import pytest

from .forked import forked_reports, report, run_scripts

SCRIPT = """
import atexit, os, sys, time
atexit.register(lambda: open(os.environ["MARK"], "w").close())
print("out", *sys.argv[1:], os.environ["WHO"])
print("err", file=sys.stderr)
time.sleep(float(os.environ.get("SLEEP_S", "0")))
sys.exit(3)
"""


def rank(index: int, sleep_s: float) -> None:
    os.write(1, b"not a report\n")  # what gloo or torch write to the same stdout is left out
    time.sleep(sleep_s)
    if index == 2:
        raise RuntimeError("rank 2 fails")
    report(index, os.getpid())


def test_each_rank_reports_from_a_process_of_its_own_and_a_failure_is_counted():
    failed, said = forked_reports(rank, [(0, 0), (1, 0), (2, 0)])
    assert failed == 1
    assert sorted(index for index, _ in said) == ["0", "1"]
    assert len({pid for _, pid in said} | {str(os.getpid())}) == 3


def test_a_rank_past_the_time_out_is_killed_and_counted():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="1 of 2 forked ranks still ran at their time-out: killed"):
        # 10 s: the rank that returns at once must end before it, on a loaded machine too (at 1 s, a CI run here
        # counted both ranks)
        forked_reports(rank, [(0, 0), (1, 600)], timeout=10)
    assert time.monotonic() - started < 60


def test_a_script_ends_as_a_process_with_its_own_exit_functions_and_none_of_the_parents(tmp_path: Path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    parents = tmp_path / "parents"

    def parents_exit() -> None:  # this process's exit function, which no child may run
        parents.touch()

    atexit.register(parents_exit)
    try:
        (ran,) = run_scripts(script, [["0"]], {"MARK": str(tmp_path / "mark0")}, 60, via="fork",
                             own_envs=[{"WHO": "child0"}], exit_functions=True)
        (skipped,) = run_scripts(script, [["1"]], {"MARK": str(tmp_path / "mark1"), "WHO": "child1"}, 60, via="fork")
    finally:
        atexit.unregister(parents_exit)
    assert (ran.returncode, ran.stdout, ran.stderr) == (3, "out 0 child0\n", "err\n")
    assert (tmp_path / "mark0").exists()
    assert skipped.returncode == 3 and not (tmp_path / "mark1").exists()  # the control: exit functions not asked for
    assert not parents.exists()


HANGING = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
def held_here():
    time.sleep(120)
held_here()
"""


def test_a_script_past_its_time_out_is_killed_and_its_stacks_shown(tmp_path: Path, capfd: pytest.CaptureFixture):
    script = tmp_path / "script.py"
    script.write_text(HANGING)
    started = time.monotonic()
    (ended,) = run_scripts(script, [[]], {}, 5, via="fork")
    child = int(ended.stdout.split()[0])
    try:
        assert ended.returncode == -signal.SIGKILL
        assert time.monotonic() - started < 90
        shown = capfd.readouterr().err  # the failing test's report shows where the script and its process waited
        assert "held_here (script.py:6)" in shown and "this process's threads: " in shown, shown
        assert f"py-spy dump of {child} " in shown and "<module> (<string>:1)" in shown, shown
    finally:
        os.kill(child, signal.SIGKILL)


def test_one_environment_per_argv_or_a_refusal_naming_it(tmp_path: Path):
    with pytest.raises(ValueError, match="own_envs: one environment per argv"):
        run_scripts(tmp_path / "script.py", [[], []], {}, 60, via="fork", own_envs=[{}])
