"""What a fleet test prints when its requests time out: every process of the fleet's stacks, the coordinator's
STATUS and the ends of the logs, so that a hang seen once under load can be read from the CI log alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

from megatron_serve.client.coordinator_client import InferenceClient
from megatron_serve.wire.security import TOKEN_ENV

from ..helpers import Children

_PY_SPY = Path(sys.executable).with_name("py-spy")


def fleet_processes(children: Children) -> list[psutil.Process]:
    """This test's fleet: its descendants, and any process holding its fleet secret that is not (a rank whose engine
    was killed and that outlived it, reparented away from the launcher)."""
    mine = {p.pid: p for p in psutil.Process().children(recursive=True)}
    marker = f"{TOKEN_ENV}={children.secret}".encode()
    for proc in psutil.process_iter():
        if proc.pid in mine or proc.pid == os.getpid():
            continue
        try:
            if marker in Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0"):
                mine[proc.pid] = proc
        except OSError:
            continue
    return list(mine.values())


def _stacks(pid: int) -> str:
    try:
        done = subprocess.run([str(_PY_SPY), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"py-spy failed: {exc}"
    return done.stdout + done.stderr


async def dump_fleet(children: Children, client: InferenceClient, log_dir: Path) -> None:
    """Print the fleet's state: STATUS, each process (parent, command line, stacks) and each log's last lines."""
    print("=== fleet dump: requests timed out ===", flush=True)
    try:
        print("STATUS:", json.dumps(await client.status(), indent=1, default=str)[:20000], flush=True)
    except Exception as exc:  # noqa: BLE001 - a coordinator that no longer answers is itself the finding
        print(f"STATUS failed: {exc!r}", flush=True)
    for proc in fleet_processes(children):
        try:
            header = f"pid {proc.pid} ppid {proc.ppid()} {proc.status()}: {' '.join(proc.cmdline())[:300]}"
        except psutil.Error as exc:
            header = f"pid {proc.pid}: {exc!r}"
        print(f"--- {header}\n{_stacks(proc.pid)}", flush=True)
    for log in sorted(log_dir.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        print(f"--- {log.name} (last 80 of {len(lines)} lines)\n" + "\n".join(lines[-80:]), flush=True)
