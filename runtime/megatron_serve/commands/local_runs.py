"""How ``megatron-serve control`` finds the fleet that ``megatron-serve run`` started on this machine.

``run`` publishes one small JSON file per process (``<pid>.json``: coordinator address, HTTP
endpoint, model, whether a token is needed) in the user's runtime directory,
``$XDG_RUNTIME_DIR/megatron-serve`` (private to the user, emptied at logout), else
``~/.cache/megatron-serve/runs``; it removes the file when it exits. ``control`` without
``--coordinator`` (and without ``$MEGATRON_SERVE_COORDINATOR``) reads them: a file whose process is
gone is stale and deleted; exactly one live run is used; none or several is an error that says what
to pass. Secrets are never written: only whether the run needs a token.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class LocalRun:
    pid: int
    coordinator: str
    endpoint: str
    model: str
    token_required: bool = False


def runs_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "megatron-serve"
    return Path.home() / ".cache" / "megatron-serve" / "runs"


def publish(run: LocalRun) -> Path:
    """Write ``run``'s file (atomically, user-only); returns its path, for :func:`withdraw`."""
    folder = runs_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / f"{run.pid}.json"
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(asdict(run)))
    partial.chmod(0o600)
    partial.replace(path)
    return path


def withdraw(path: Path) -> None:
    path.unlink(missing_ok=True)


def live_runs() -> list[LocalRun]:
    """Every published run whose process still exists (stale files are deleted on the way)."""
    found = []
    for path in sorted(runs_dir().glob("*.json")):
        try:
            run = LocalRun(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # being written, or not ours: leave it
        if _alive(run.pid):
            found.append(run)
        else:
            path.unlink(missing_ok=True)
    return found


def find_local_run() -> LocalRun:
    """The one live local run; ``LookupError`` saying what to do when there is none or several."""
    runs = live_runs()
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise LookupError("no --coordinator given and no `megatron-serve run` is running on this machine: start one, "
                          "or pass --coordinator tcp://HOST:5555")
    listed = ", ".join(f"{r.coordinator} (pid {r.pid}, {r.model})" for r in runs)
    raise LookupError(f"{len(runs)} `megatron-serve run` processes on this machine: {listed}; pass --coordinator")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True
