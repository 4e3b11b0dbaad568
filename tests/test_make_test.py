"""The README's second command, ``make test``, on a fresh clone: it builds everything the suite runs (verl's venv
too), cleans up what the suite wrote to the temporary directory, however the suite ends, and CI runs exactly it.

The recipe runs for real (GNU make, /bin/sh) with the interpreter replaced by a stand-in script that does what pytest
does to the temporary directory (a tmp_path folder, a multiprocessing ``pymp-*`` folder) and then fails or waits
for Ctrl-C: the suite itself is too long to run here. ``-o`` keeps make from reinstalling the venvs on its account.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = (".venv/.installed-runtime", ".venv/.installed-test", ".venv-verl/.installed")

# What pytest does to TMPDIR, then exit 3 (tests failed), or wait for SIGINT and exit 2 as pytest does.
STAND_IN = """#!/bin/sh
case "$*" in *compileall*) exit 0 ;; esac
echo "$TMPDIR" > "{record}"
echo "pytest $KUBECONFIG $MEGATRON_KUBE_CLUSTER_DIR $(echo "$*" | grep -o -- '--kube-cluster-down-when-unused=[^ ]*')" >> "{calls}"
mkdir -p "$TMPDIR/pytest-of-me/pytest-0/test_a0" "$TMPDIR/pymp-abc/listener-x"
case "{mode}" in
  fail) exit 3 ;;
  wait) trap 'exit 2' INT; touch "{record}.waiting"; while :; do sleep 0.05; done ;;
esac
"""
# tools/kube-cluster's stand-in: records each call (the real one starts a control plane; tests/operator/
# test_kube_cluster.py checks that one).
KUBE_STAND_IN = """#!/bin/sh
echo "$*" >> "{calls}"
"""


def make_test(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path]:
    """``make test`` with the stand-in interpreter (``mode``: ``fail`` or ``wait``); the file it records TMPDIR in."""
    record = tmp_path / "tmpdir"
    calls = tmp_path / "kube-calls"
    stand_in = tmp_path / "python"
    stand_in.write_text(STAND_IN.format(record=record, mode=mode, calls=calls))
    kube_stand_in = tmp_path / "kube-cluster"
    kube_stand_in.write_text(KUBE_STAND_IN.format(calls=calls))
    for script in (stand_in, kube_stand_in):
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    keep = [arg for path in INSTALLED for arg in ("-o", path)]
    env = {**os.environ, "TMPDIR": str(tmp_path), "KUBECONFIG": str(tmp_path / "kubeconfig")}
    env.pop("CI", None)
    # SIGINT as a terminal's Ctrl-C finds it: a suite started in the background by a non-interactive shell (`... &`)
    # inherits SIGINT ignored, and a shell cannot trap a signal ignored when it started, so the stand-in never ended
    proc = subprocess.Popen(["make", "-C", str(ROOT), "--no-print-directory", *keep, "test", f"PY={stand_in}",
                             f"KUBE_CLUSTER={kube_stand_in}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, preexec_fn=default_sigint)
    return proc, record


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def suite_command(**variables: str) -> str:
    """The pytest command of ``make -n test`` with ``variables`` set in make's environment (CI unset otherwise)."""
    env = {key: value for key, value in os.environ.items() if key not in ("CI", "SCENARIOS")}
    dry = subprocess.run(["make", "-C", str(ROOT), "--no-print-directory", "-n", "test"], capture_output=True,
                         text=True, timeout=120, env={**env, **variables})
    assert dry.returncode == 0, dry.stderr
    return dry.stdout[dry.stdout.index("-m pytest"):].split("status=")[0]  # the command's continued lines


def test_a_developers_make_test_leaves_the_day2_scenarios_to_ci():
    """The tests marked ``scenario`` (minutes of streamed load on the real control plane each) run under CI, which
    sets CI=true, or with SCENARIOS=1; a developer's warm ``make test`` leaves them out to stay within its time."""
    assert '-m "not scenario"' in suite_command()
    assert "not scenario" not in suite_command(CI="true")
    assert "not scenario" not in suite_command(SCENARIOS="1")


def test_the_day2_scenarios_are_marked(tmp_path):
    """What `-m "not scenario"` leaves out: the rolling update and drain, the HPA and wake-from-zero files, and no
    other test."""
    listed = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                             "-m", "scenario", "tests/operator"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    files = {line.split("::")[0] for line in listed.stdout.splitlines() if "::" in line}
    assert files == {"tests/operator/test_real_under_load.py", "tests/operator/test_real_hpa.py",
                     "tests/operator/test_real_scale_to_zero.py"}, listed.stdout


def test_a_fresh_clone_builds_verls_venv_for_the_suite(tmp_path):
    """On a clone without ``.venv-verl`` (here: pointed elsewhere), ``make test`` builds it before the suite runs
    (tests/integrations/test_verl.py needs it; only ``make setup`` built it, and CI ran that first)."""
    dry = subprocess.run(["make", "-C", str(ROOT), "--no-print-directory", "-n", "test",
                          f"VERL_VENV={tmp_path / 'venv-verl'}"], capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    built = next(i for i, line in enumerate(lines) if "uv venv" in line and str(tmp_path / "venv-verl") in line)
    suite = next(i for i, line in enumerate(lines) if "-m pytest" in line)
    assert built < suite, dry.stdout


def test_setup_and_test_install_ccache_before_they_build_the_cpu_kernels(tmp_path):
    """torch compiles the CPU kernels through ccache where it is on PATH: on a fresh machine the venvs' first builds
    go through it only if it is installed before them."""
    for target in ("setup", "test"):
        dry = subprocess.run(["make", "-C", str(ROOT), "--no-print-directory", "-n", target, f"VENV={tmp_path / 'venv'}",
                              f"VERL_VENV={tmp_path / 'venv-verl'}"], capture_output=True, text=True, timeout=120)
        assert dry.returncode == 0, dry.stderr
        lines = dry.stdout.splitlines()
        ccache = next(i for i, line in enumerate(lines) if "apt-get install" in line and "ccache" in line)
        kernels = [i for i, line in enumerate(lines) if "-m megatron_kernels" in line]
        assert len(kernels) == 2 and ccache < min(kernels), dry.stdout


def test_what_the_suite_wrote_to_the_temporary_directory_goes_when_it_fails(tmp_path):
    proc, record = make_test(tmp_path, "fail")
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, output  # the suite's failure is make's
    suite_tmp = Path(record.read_text().strip())
    assert suite_tmp.parent == tmp_path and suite_tmp != tmp_path, suite_tmp  # a directory of its own, under TMPDIR
    assert not suite_tmp.exists(), list(suite_tmp.rglob("*"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kube-calls", "kube-cluster", "python", "tmpdir"]
    assert_the_cluster_came_up_for_the_suite_and_went_down(tmp_path, suite_tmp)


def test_what_the_suite_wrote_goes_after_ctrl_c_too(tmp_path):
    proc, record = make_test(tmp_path, "wait")
    try:
        wait_until(lambda: Path(f"{record}.waiting").exists(), 60, "the stand-in suite to start")
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal (or CI's timeout -s INT)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0, output
    suite_tmp = Path(record.read_text().strip())
    assert not suite_tmp.exists(), list(suite_tmp.rglob("*"))
    assert_the_cluster_came_up_for_the_suite_and_went_down(tmp_path, suite_tmp)


def assert_the_cluster_came_up_for_the_suite_and_went_down(tmp_path: Path, suite_tmp: Path) -> None:
    """kube-tools built, a cluster came up in the suite's TMPDIR, pytest saw it (and may stop it once its tests are
    done: tests/operator/cluster_users.py), and it went down after."""
    kube = suite_tmp / "kube"
    calls = (tmp_path / "kube-calls").read_text().splitlines()
    assert calls == ["build", f"up {kube}", f"pytest {kube}/kubeconfig {kube} --kube-cluster-down-when-unused={kube}",
                     f"down {kube}"], calls


def test_ci_runs_exactly_the_readmes_make_test():
    """No setup step of its own before it (one hid that ``make test`` did not build verl's venv)."""
    readme = (ROOT / "README.md").read_text()
    assert "make test   #" in readme
    commands = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    makes = [line for line in commands if "make " in line]
    assert makes == ["timeout -s INT -k 120 80m make test"], makes
