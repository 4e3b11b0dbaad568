"""The runs ``megatron-serve run`` keeps on this machine: where ``control`` (and ``server``) find them and their secret.

Each run has a directory of its own, ``<runs>/<pid>/`` (mode 0700), holding ``run.json`` (the
coordinator's address, the HTTP endpoint, the model, the working directory ``run`` started in) and
``secret`` (the run's fleet secret; absent for an ``--insecure`` run), both mode 0600. ``<runs>`` is
``$XDG_RUNTIME_DIR/megatron-serve`` (private to the user, emptied at logout), else
``~/.cache/megatron-serve/runs``; it must belong to this user and be 0700, or it is refused. The run
removes its directory when it exits, its janitor (:mod:`.run_janitor`) when it is killed, and the
next run of this user when both were.

``control`` without ``--coordinator`` (and without ``$MEGATRON_SERVE_COORDINATOR``) considers only
runs of this OS user (owner checked on every file) started in the current working directory: one
is used, none or several is an error that says what to pass. Given an address, ``control`` and
``server`` read the secret of this user's run at that address. A directory whose process is gone is
stale and deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..processes.pids import process_exists

RUN_FILE = "run.json"
SECRET_FILE = "secret"


class UnsafeRunsDirectory(RuntimeError):
    """The runs directory belongs to another user, or others may read it."""


@dataclass(frozen=True)
class LocalRun:
    pid: int
    coordinator: str
    endpoint: str
    model: str
    cwd: str
    directory: Path = field(default=Path(), compare=False)  # where it is kept (not in run.json)

    def secret(self) -> str | None:
        """The run's fleet secret (``None``: an ``--insecure`` run)."""
        path = self.directory / SECRET_FILE
        if not _private_file(path):
            return None
        return path.read_text().strip() or None


def runs_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "megatron-serve"
    return Path.home() / ".cache" / "megatron-serve" / "runs"


def _own_private_dir(path: Path, create: bool) -> bool:
    """Whether ``path`` is a directory of this user that only they can enter (made so when ``create``);
    raises :class:`UnsafeRunsDirectory` for one that belongs to someone else or is open to others."""
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise UnsafeRunsDirectory(f"{path} is not a directory of this user (uid {os.getuid()}): remove it, or set "
                                  "$XDG_RUNTIME_DIR to a directory of your own")
    if info.st_mode & 0o077:
        raise UnsafeRunsDirectory(f"{path} is open to other users (mode {oct(info.st_mode & 0o777)}): "
                                  f"chmod 700 {path}")
    return True


def _private_file(path: Path) -> bool:
    """A regular file of this user that only they can read."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to a new file only this user can read (created 0600, never widened)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def publish(pid: int, coordinator: str, endpoint: str, model: str, secret: str | None) -> LocalRun:
    """Keep this run's facts and secret in its own directory; :func:`withdraw` removes it."""
    base = runs_dir()
    _own_private_dir(base, create=True)
    live_runs()  # deletes the directories of runs that are gone (killed together with their janitor)
    directory = base / str(pid)
    if directory.exists():  # a stale one of an earlier process with this pid
        shutil.rmtree(directory)
    directory.mkdir(mode=0o700)
    run = LocalRun(pid=pid, coordinator=coordinator, endpoint=endpoint, model=model, cwd=os.getcwd(),
                   directory=directory)
    if secret is not None:
        _write_private(directory / SECRET_FILE, secret + "\n")
    facts = {k: v for k, v in asdict(run).items() if k != "directory"}
    _write_private(directory / f"{RUN_FILE}.tmp", json.dumps(facts))
    os.replace(directory / f"{RUN_FILE}.tmp", directory / RUN_FILE)  # readers never see half a file
    return run


def withdraw(run: LocalRun) -> None:
    shutil.rmtree(run.directory, ignore_errors=True)


def live_runs() -> list[LocalRun]:
    """This user's runs whose process still exists (stale directories are deleted on the way)."""
    base = runs_dir()
    if not _own_private_dir(base, create=False):
        return []
    found = []
    for directory in sorted(base.iterdir()):
        path = directory / RUN_FILE
        try:
            if not (_own_private_dir(directory, create=False) and _private_file(path)):
                continue  # being written
        except UnsafeRunsDirectory:
            continue  # not this user's, or open to others: never read
        try:
            run = LocalRun(**json.loads(path.read_text()), directory=directory)
        except (OSError, ValueError, TypeError):
            continue
        if process_exists(run.pid):
            found.append(run)
        else:
            shutil.rmtree(directory, ignore_errors=True)
    return found


def find_local_run(cwd: str | None = None) -> LocalRun:
    """This user's one live run started in ``cwd`` (default: the current directory); ``LookupError``
    saying what to do when there is none or several."""
    cwd = os.path.realpath(cwd or os.getcwd())
    runs = live_runs()
    here = [r for r in runs if os.path.realpath(r.cwd) == cwd]
    if len(here) == 1:
        return here[0]
    if len(here) > 1:
        listed = ", ".join(f"{r.coordinator} (pid {r.pid}, {r.model})" for r in here)
        raise LookupError(f"{len(here)} `megatron-serve run` processes started in {cwd}: {listed}; pass --coordinator")
    if runs:
        listed = ", ".join(f"{r.coordinator} (pid {r.pid}, started in {r.cwd})" for r in runs)
        raise LookupError(f"no `megatron-serve run` of yours was started in {cwd}; yours elsewhere: {listed}: pass "
                          "--coordinator ADDRESS (its secret is found), or run this command in that directory")
    raise LookupError("no --coordinator given and no `megatron-serve run` is running on this machine: start one, "
                      "or pass --coordinator tcp://HOST:5555")


def secret_for(address: str) -> str | None:
    """The secret of this user's live run whose coordinator is ``address`` (``None``: no such run, or an
    insecure one)."""
    run = next((r for r in live_runs() if r.coordinator == address), None)
    return run.secret() if run is not None else None
