"""What a fleet test prints when its requests are slow to answer: every process of the fleet's stacks, the coordinator's
STATUS and the ends of the logs, so that a hang seen once under load can be read from the CI log alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.wire.security import TOKEN_ENV

from ..helpers import Children

_PY_SPY = Path(sys.executable).with_name("py-spy")


def fleet_processes(children: Children) -> list[int]:
    """This test's fleet: every process whose environment holds its fleet secret (its children have it, forked ones
    from the launcher's; a rank that outlived its killed engine, reparented away from the launcher, too)."""
    marker = f"{TOKEN_ENV}={children.secret}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return sorted(pids)


def _describe(pid: int) -> str:
    try:
        parent = (Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split() or ["?", "?"])[1]
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError as exc:
        return f"pid {pid}: {exc}"
    return f"pid {pid} ppid {parent}: {command[:300]}"


def _stacks(pid: int) -> str:
    try:
        done = subprocess.run([str(_PY_SPY), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"py-spy failed: {exc}"
    return done.stdout + done.stderr


async def dump_fleet(children: Children, client: InferenceClient, log_dir: Path) -> None:
    """Print the fleet's state: STATUS, each process (parent, command line, stacks) and each log's last lines."""
    print("=== fleet dump: requests still unanswered ===", flush=True)
    try:
        print("STATUS:", json.dumps(await client.status(), indent=1, default=str)[:20000], flush=True)
    except Exception as exc:  # noqa: BLE001 - a coordinator that no longer answers is itself the finding
        print(f"STATUS failed: {exc!r}", flush=True)
    for pid in fleet_processes(children):
        print(f"--- {_describe(pid)}\n{_stacks(pid)}", flush=True)
    for log in sorted(log_dir.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        print(f"--- {log.name} (last 80 of {len(lines)} lines)\n" + "\n".join(lines[-80:]), flush=True)
