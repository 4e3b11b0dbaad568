"""``benchmarks/idle_cpu.py`` starts a stack, reads each process's CPU over idle seconds and prints it by role; bad
arguments are refused by name."""

from __future__ import annotations

from tests.benchmarks.scripts import run_script


def test_one_short_round_prints_each_role_and_cleans_up(tmp_path):
    result = run_script("idle_cpu.py", "--seconds", "1", "--rounds", "1", "--settle", "0.5",
                        env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert not list(tmp_path.glob("bench-*")), list(tmp_path.iterdir())  # the model and logs went with the stack
    lines = result.stdout.splitlines()
    assert "| round | server | coordinator | engines |" in lines
    median = next(line for line in lines if line.startswith("| median |"))
    figures = [float(cell) for cell in median.strip("|").split("|")[1:]]
    assert len(figures) == 3 and all(f > 0 for f in figures), median  # every process runs its clock


def test_bad_arguments_are_refused_by_name():
    for argv, named in ((("--rounds", "0"), "--rounds"), (("--seconds", "-1"), "--seconds")):
        result = run_script("idle_cpu.py", *argv)
        assert result.returncode == 2 and named in result.stderr, result.stderr
